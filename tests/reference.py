"""Plain float32 transformers references: unmodified models (no genscore code), called as `model(input_ids).logits`
one sequence at a time, and the logprobs modes written with transformers' own warpers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
NEG_INF_JSON = -9999.0


def mode_values(logits: torch.Tensor, mode: str, processors: dict) -> torch.Tensor:
    """[V] float32 logits of one position -> that position's values under `mode`, as DESIGN.md defines them
    (processors in the order logit_bias, temperature, min_p, top_k, top_p)."""
    x = logits.float().clone()[None]  # [1, V]
    if mode.startswith("processed"):
        for token, bias in (processors.get("logit_bias") or {}).items():
            x[0, int(token)] += bias
        warpers = []
        if processors.get("temperature"):
            warpers.append(TemperatureLogitsWarper(processors["temperature"]))
        if processors.get("min_p"):
            warpers.append(MinPLogitsWarper(processors["min_p"]))
        if processors.get("top_k"):
            warpers.append(TopKLogitsWarper(processors["top_k"]))
        if processors.get("top_p"):
            warpers.append(TopPLogitsWarper(processors["top_p"]))
        x = LogitsProcessorList(warpers)(torch.zeros((1, 1), dtype=torch.long), x)
    return torch.log_softmax(x, -1)[0] if mode.endswith("logprobs") else x[0]


def as_json(values) -> list[float]:
    values = values.tolist() if isinstance(values, torch.Tensor) else values
    return [NEG_INF_JSON if v == float("-inf") else v for v in values]


def plain_model(folder: str | Path, dtype: torch.dtype = torch.float32, **kwargs):
    """The model exactly as transformers loads it, in eval mode: the reference every "matches transformers" test
    compares with. Loaded straight with from_pretrained, so none of genscore's loading or serving code runs."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs).eval()
    assert_plain(model)
    return model


def assert_plain(model) -> None:
    """Refuse a model with genscore's serving kernels installed: a reference computed with the code under test
    would agree with any bug in it."""
    foreign = sorted({type(m).__module__ for m in model.modules()
                      if not type(m).__module__.startswith(("torch.", "transformers."))})
    assert not foreign, f"reference model holds modules from {foreign} (genscore's serving kernels?)"
    attention = model.config._attn_implementation
    assert attention in ("sdpa", "eager"), f"reference model uses the attention implementation {attention!r}"


def position_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits [T, V] of every position of one unpadded sequence, from a plain model."""
    assert_plain(model)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def last_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits [V] of the last position of one unpadded sequence, from a plain model."""
    return position_logits(model, ids)[-1]


def greedy_reference(model, ids: list[int], max_new_tokens: int, pad_token_id: int | None = None) -> list[int]:
    """transformers' own greedy decoding of one unpadded prompt on a plain model: the generated ids."""
    assert_plain(model)
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=pad_token_id)
    return out[0, len(ids):].tolist()


def candidate_reference(model, prompt: list[int], candidate: list[int], mode: str, processors: dict) -> list[float]:
    """Each candidate token's value after prompt + the candidate tokens before it, from one full forward pass."""
    logits = position_logits(model, prompt + candidate)
    return [mode_values(logits[len(prompt) - 1 + j], mode, processors)[t].item() for j, t in enumerate(candidate)]
