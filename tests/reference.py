"""Plain float32 transformers references for the logprobs modes, written with transformers' own warpers."""

from __future__ import annotations

import torch
from transformers import (
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


def position_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits [T, V] of every position of one unpadded sequence."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def candidate_reference(model, prompt: list[int], candidate: list[int], mode: str, processors: dict) -> list[float]:
    """Each candidate token's value after prompt + the candidate tokens before it, from one full forward pass."""
    logits = position_logits(model, prompt + candidate)
    return [mode_values(logits[len(prompt) - 1 + j], mode, processors)[t].item() for j, t in enumerate(candidate)]
