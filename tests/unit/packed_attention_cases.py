"""What the tests of the packed-attention op's kernels share: a small model whose attention patterns matter, prompts
of several lengths, its plain forward, a packed plan through a kernel, and the shared-prefix check."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import models.attention_cpu as attention_cpu
from models.head import head_logits
from models.packed import LOOP, use_packed_attention
from models.prefix import SuffixRow, forward_suffixes, prefill_prefixes, prefill_with_suffixes
from models.selfcheck import plain_plan


def require_cpu_kernels() -> None:
    """Build genscore's CPU attention kernels once per process, or skip: a machine without a compiler serves the
    per-segment loop and SDPA instead."""
    error = attention_cpu.build_error(None)
    if error is not None:
        pytest.skip(error)


def attention_model(window: int | None, layers: int = 2):
    """A 4/2-head Llama (or Mistral with a sliding `window`) whose queries and keys are scaled up, so that a dropped
    window or a key read from the wrong segment shows in the logits."""
    body = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=300, num_hidden_layers=layers, max_position_embeddings=256)
    config = transformers.MistralConfig(**body, sliding_window=window) if window else transformers.LlamaConfig(**body)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.mul_(4.0)
    return model


def sample_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 299, (n,), generator=generator).tolist() for n in (5, 23, 40, 1, 17)]


def plain_last_logits(model, prompts) -> torch.Tensor:
    """Each prompt's last-position logits from the model's own forward, one prompt at a time: [N, V]."""
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])


def packed_plan(model, kernel: str = LOOP):
    """The plan of packed calls (and packed suffixes over key/value prefixes) through `kernel`."""
    assert use_packed_attention(model)
    return replace(plain_plan(model), layout="packed", prefix_reuse="key_values", packed_suffixes=True,
                   attention_kernel=kernel)


def assert_shared_prefixes_give_the_plain_forward(model, plan) -> None:
    """Suffixes over a prefix's states, and prefixes run with their suffixes in one call: each suffix's last
    positions as in a plain pass of prefix + suffix."""
    generator = torch.Generator().manual_seed(2)
    prefixes = [torch.randint(1, 299, (n,), generator=generator).tolist() for n in (12, 30)]
    rows = [(0, torch.randint(1, 299, (n,), generator=generator).tolist(), k) for n, k in ((5, 2), (9, 1))]
    rows += [(1, torch.randint(1, 299, (n,), generator=generator).tolist(), k) for n, k in ((3, 4), (17, 3))]
    with torch.inference_mode():
        expected = torch.cat([model(torch.tensor([prefixes[p] + s])).logits[0, len(prefixes[p]) + len(s) - k:]
                              for p, s, k in rows])
    _, hidden = prefill_with_suffixes(model, plan, prefixes, rows, 0)
    torch.testing.assert_close(head_logits(plan, hidden), expected, atol=1e-4, rtol=0)
    states = prefill_prefixes(model, plan, prefixes, 0)
    hidden = forward_suffixes(model, plan, [SuffixRow(states[p], tuple(s), k) for p, s, k in rows], 0)
    torch.testing.assert_close(head_logits(plan, hidden), expected, atol=1e-4, rtol=0)
