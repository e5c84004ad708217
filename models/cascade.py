"""Cascade attention over a shared prefix: queries attend to their prefix's keys in one non-causal call and to their
own keys causally, and the two partial results merge by log-sum-exp; no mask, no copy of the prefix."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from models.packed import PackedRow, PackingUnsupported, _groups

CASCADE = "cascade"  # a ForwardPlan's prefix_attention when the self-check proved this path
MASKED = "masked"
CASCADE_PATH = "cascade_attention"  # its name among the fast paths (models/selfcheck.py)
# Why the self-check does not try it (logged at info: not a disagreement).
NEEDS_PACKED_SUFFIXES = "cascade attention runs packed suffixes, and they are off"

_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def merge_by_lse(first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
                 ) -> torch.Tensor:
    """Attention over two disjoint sets of keys, from each set's own result: the softmax over their union weighs each
    part by its share of the total exp-sum. first, second [..., L, D] (any dtype); first_lse, second_lse [..., L]
    float32, the natural log of each part's sum of exp(score). A part with no keys has lse -inf and weight 0.
    Computed in float32 (so a bfloat16 result rounds once, at the end) and returned in first's dtype."""
    top = torch.maximum(first_lse, second_lse)  # [..., L]: keeps exp() from overflowing
    first_weight = (first_lse - top).exp_().unsqueeze(-1)  # [..., L, 1]
    second_weight = (second_lse - top).exp_().unsqueeze(-1)
    merged = first_weight * first.float() + second_weight * second.float()
    return merged.div_(first_weight + second_weight).to(first.dtype)


def prefix_runs(row: PackedRow, tokens: int, past: int) -> list[tuple[int, int, int, int]]:
    """Consecutive segments of the row that read the same non-empty span of keys, as (a, b, s, e): queries a:b of the
    row read keys s:e. One non-causal call serves each run, however many segments it holds."""
    spans = [(0, past)] * (len(row.bounds) - 1) if row.spans is None else row.spans
    return [run for run in _groups(row.bounds, spans, tokens) if run[2] < run[3]]


def refusal(window: int | None, dropout: float | None) -> str | None:
    """Why an attention call cannot run as a cascade (None: it can). A cascade reads every key of the prefix and
    every earlier key of the segment, so a sliding window (of any size: the probe must meet the same refusal as a
    served call) is refused, as is dropout."""
    if window is not None:
        return f"a sliding window of {window} (a cascade reads every key of the prefix)"
    if dropout:
        return f"dropout {dropout}"
    return None


def model_refusal(device: torch.device, attention_kernel: str, dtype: torch.dtype = torch.float32) -> str | None:
    """Why a model on `device` in `dtype` whose packed attention runs `attention_kernel` has no cascade kernel (None: it
    has one, subject to the self-check): on CPU, ATen's flash kernel; on CUDA, the varlen kernel with its log-sum-exp.
    Half precision is refused: each part comes back rounded to it before the merge, two roundings where the masked
    call has one, which moves labels further from the model's own numbers than the masked path does."""
    if dtype != torch.float32:
        return f"cascade attention rounds each part to {dtype} before merging them"
    if device.type == "cpu":
        return None if _flash_cpu is not None else f"torch {torch.__version__} has no CPU flash attention kernel"
    if device.type == "cuda":
        from models.attention_cuda import VARLEN, varlen_lse_refusal

        if attention_kernel != VARLEN:
            return "cascade attention on CUDA runs through the varlen kernel, which is off for this model"
        return varlen_lse_refusal()
    return f"no cascade attention kernel on {device.type}"


def cascade_attention(row: PackedRow, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      key_value_groups: int, scaling: float | None, window: int | None = None,
                      dropout: float | None = None) -> torch.Tensor:
    """The attention of a packed call over spans (models/packed.py, a PackedRow built with cascade=True): each
    segment's queries over its span's keys and over its own keys up to each query, [1, T, H, D].

    query [1, H, T, D]; key, value [1, H_kv, past + T, D]: the span keys (a shared prefix's states before the row, or
    a prefix's segment in the row itself) are read where they lie. The row carries no mask, so a call this path
    cannot honour raises PackingUnsupported (the self-check then switches the path off) instead of falling back.
    """
    reason = refusal(window, dropout)
    if reason is not None:
        raise PackingUnsupported(f"cascade attention refuses {reason}")
    tokens = query.shape[2]
    runs = prefix_runs(row, tokens, key.shape[2] - tokens)
    if query.device.type == "cuda":
        from models.attention_cuda import cascade_attention_cuda

        out = cascade_attention_cuda(row, runs, query, key, value, key_value_groups, scaling)
        if out is None:
            raise PackingUnsupported("cascade attention on CUDA needs the varlen kernel with its log-sum-exp")
        return out
    if query.device.type != "cpu" or _flash_cpu is None:
        raise PackingUnsupported(f"cascade attention has no kernel returning the log-sum-exp on {query.device.type}")
    return _cascade_cpu(row, runs, query, key, value, scaling)


def _cascade_cpu(row: PackedRow, runs: Sequence[tuple[int, int, int, int]], query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """cascade_attention through ATen's CPU flash kernel, which returns the log-sum-exp and takes fewer key/value
    heads than query heads as they are (grouped-query attention without repeating keys)."""
    past = key.shape[2] - query.shape[2]
    outs, lses = [], []
    for a, b in zip(row.bounds[:-1], row.bounds[1:]):
        if a == b:
            continue  # an empty segment has no queries
        own = slice(past + a, past + b)
        out, lse = _flash_cpu(query[:, :, a:b], key[:, :, own], value[:, :, own], is_causal=True, scale=scaling)
        outs.append(out)  # [1, H, L, D]
        lses.append(lse)  # [1, H, L] float32
    out = torch.cat(outs, dim=2)  # [1, H, T, D]: each segment over its own keys, causally
    lse = torch.cat(lses, dim=2)  # [1, H, T]
    for a, b, s, e in runs:
        # the span's keys are a view of the past: one call for every query that reads them, none copied
        spanned, spanned_lse = _flash_cpu(query[:, :, a:b], key[:, :, s:e], value[:, :, s:e], scale=scaling)
        out[:, :, a:b] = merge_by_lse(out[:, :, a:b], lse[:, :, a:b], spanned, spanned_lse)
    return out.transpose(1, 2)  # [1, T, H, D]
