"""The CUDA implementation of the packed-attention op: one `varlen_attn` (flash attention) call per layer over the
whole packed row, causal inside each segment, with the layer's sliding window; it refuses what it cannot honour."""

from __future__ import annotations

import inspect
import logging
from functools import lru_cache

import torch

log = logging.getLogger("genscore.models")

VARLEN = "varlen"  # the kernel name a ForwardPlan's attention_kernel and a PackedRow carry
# What flash attention computes in and runs on: anything else runs the per-segment loop.
_DTYPES = (torch.float16, torch.bfloat16)
_DEVICE_TYPES = ("cuda",)
_MAX_HEAD_DIM = 256


@lru_cache(maxsize=1)
def _varlen():
    """torch's varlen_attn and the keyword arguments this torch version takes, or None where it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the varlen kernel cannot run a model on `device` in `dtype` (None: it can, subject to the self-check)."""
    if device.type not in _DEVICE_TYPES:
        return "varlen attention runs on CUDA only"
    if _varlen() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if dtype not in _DTYPES:
        return f"flash attention does not compute in {dtype}"
    if head_dim > _MAX_HEAD_DIM or head_dim % 8:
        return f"flash attention does not take a head dimension of {head_dim}"
    return None


_REFUSED: set[str] = set()


def _refuse(reason: str) -> None:
    if reason not in _REFUSED:  # once per reason: a refusal holds for every later call of the same layer
        _REFUSED.add(reason)
        log.warning("varlen attention refuses a call (%s): it runs the per-segment loop", reason)


def _match_query_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_value_groups: int,
                       params: frozenset, extra: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention for varlen_attn: where the key/value heads are fewer than the query heads, either ask
    the kernel to share them (enable_gqa, set in `extra`) or, where this torch's varlen_attn cannot, repeat them.

    q [Tq, H, D]; k, v [Tk, H_kv, D] with H = H_kv * key_value_groups. Returns k, v as [Tk, H_kv, D] when the kernel
    shares the heads (or there is nothing to share), else [Tk, H, D].
    """
    if k.shape[1] == q.shape[1]:
        return k, v
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
        return k, v
    # each key/value head serves key_value_groups query heads in a row, as transformers' repeat_kv
    return k.repeat_interleave(key_value_groups, dim=1), v.repeat_interleave(key_value_groups, dim=1)


def segment_attention_fast(
    kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor, max_length: int, key_value_groups: int, scaling: float | None, window: int | None,
) -> torch.Tensor | None:
    """models/packed.py segment_attention through `kernel`: [1, T, H, D], or None where it cannot honour the call.

    query [1, H, T, D]; key, value [1, H_kv, T, D]; cu_seqlens [n + 1] int32 on the device. The kernel reads no mask:
    it computes causal attention inside each segment, limited to the layer's sliding window where it has one, so a
    mask it cannot read as exactly that (one without a window to explain it) is refused.
    """
    found = _varlen()
    if kernel != VARLEN or found is None or query.device.type not in _DEVICE_TYPES or query.dtype not in _DTYPES:
        return None
    if attention_mask is not None and window is None:
        _refuse("a mask that is not a sliding window")
        return None
    varlen_attn, params = found
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, H_kv, D]
    v = value[0].transpose(0, 1)
    extra: dict = {"scale": scaling}
    if "window_size" in params:
        # transformers' window W lets a token see itself and the W - 1 before it
        extra["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    elif window is not None:
        _refuse("this torch's varlen_attn takes no window")
        return None
    else:
        extra["is_causal"] = True
    k, v = _match_query_heads(q, k, v, key_value_groups, params, extra)
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, **extra)  # [T, H, D]
    return out[None]  # [1, T, H, D]


VARLEN_PATH = "varlen_attention"  # its name among the fast paths (models/selfcheck.py)


def runs_varlen_on(device: torch.device) -> bool:
    """Whether `device` is one the varlen kernel serves at all (the self-check reports no varlen path elsewhere)."""
    return device.type in _DEVICE_TYPES


def model_head_dim(model) -> int:
    """A loaded model's attention head dimension, from its (text) config."""
    config = model.config.get_text_config()
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def model_varlen_refusal(model) -> str | None:
    """varlen_refusal for a loaded model: its device, its dtype and its attention head dimension."""
    return varlen_refusal(model.device, model.dtype, model_head_dim(model))


def spanned_attention_fast(row, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_value_groups: int,
                           scaling: float | None) -> torch.Tensor | None:
    """Segments that read a span of other keys (a shared prefix's) before their own, in one varlen call: each
    segment's keys gathered back to back (its span's, then its own), its queries aligned to the end of them, so
    causal attention is the span plus its own tokens up to itself. [1, T, H, D], or None where it cannot run.

    query [1, H, T, D]; key, value [1, H_kv, past + T, D]; row a models/packed.py PackedRow with key_index.
    """
    found = _varlen()
    if (row.kernel != VARLEN or found is None or query.device.type not in _DEVICE_TYPES
            or query.dtype not in _DTYPES or "window_size" not in found[1]):
        return None
    varlen_attn, params = found
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1).index_select(0, row.key_index)  # [sum of span + length, H_kv, D]
    v = value[0].transpose(0, 1).index_select(0, row.key_index)
    extra: dict = {"scale": scaling, "window_size": (-1, 0)}  # causal, aligned to each segment's last key
    k, v = _match_query_heads(q, k, v, key_value_groups, params, extra)
    out = varlen_attn(q, k, v, row.cu_seqlens, row.cu_seqlens_k, row.max_length, row.max_key_length, **extra)
    return out[None]  # [1, T, H, D]


def varlen_lse_refusal() -> str | None:
    """Why this torch's varlen kernel cannot serve cascade attention (None: it can): cascade needs its log-sum-exp."""
    found = _varlen()
    if found is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if "return_aux" not in found[1]:
        return f"torch {torch.__version__}'s varlen_attn returns no log-sum-exp"
    return None


def _lse_tokens_first(lse: torch.Tensor, tokens: int, heads: int) -> torch.Tensor:
    """varlen_attn's log-sum-exp as [T, H] float32: flash attention's kernel hands it back heads first, [H, T]."""
    if lse.shape == (heads, tokens):
        return lse.float().transpose(0, 1)
    if lse.shape == (tokens, heads):
        return lse.float()
    raise RuntimeError(f"varlen_attn returned a log-sum-exp of shape {tuple(lse.shape)} for {tokens} x {heads}")


def cascade_attention_cuda(row, runs, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           key_value_groups: int, scaling: float | None) -> torch.Tensor | None:
    """models/cascade.py cascade_attention through varlen_attn: one causal call over every segment's own keys, one
    non-causal call per run of segments reading the same span (its keys a slice of the past, not gathered per
    segment), merged by log-sum-exp. [1, T, H, D], or None where the kernel cannot run.

    query [1, H, T, D]; key, value [1, H_kv, past + T, D]; row a models/packed.py PackedRow built with cascade=True
    (its run_cu holds each run's boundaries on the device, in the order of `runs`); runs (a, b, s, e): queries a:b
    read keys s:e.
    """
    from models.cascade import merge_by_lse

    found = _varlen()
    if (row.kernel != VARLEN or found is None or "return_aux" not in found[1] or query.device.type not in _DEVICE_TYPES
            or query.dtype not in _DTYPES or (runs and row.run_cu is None)):
        return None
    varlen_attn, params = found
    from torch.nn.attention.varlen import AuxRequest

    tokens, heads = query.shape[2], query.shape[1]
    past = key.shape[2] - tokens
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [past + T, H_kv, D]
    v = value[0].transpose(0, 1)
    extra: dict = {"scale": scaling, "return_aux": AuxRequest(lse=True)}
    k, v = _match_query_heads(q, k, v, key_value_groups, params, extra)

    def call(q_part, k_part, v_part, cu_q, cu_k, max_q, max_k, causal):
        if "window_size" in params:
            mode = {"window_size": (-1, 0) if causal else (-1, -1)}
        else:
            mode = {"is_causal": causal}
        out, lse = varlen_attn(q_part, k_part, v_part, cu_q, cu_k, max_q, max_k, **extra, **mode)
        return out, _lse_tokens_first(lse, q_part.shape[0], heads)  # [L, H, D], [L, H]

    out, lse = call(q, k[past:], v[past:], row.cu_seqlens, row.cu_seqlens, row.max_length, row.max_length, True)
    for i, (a, b, s, e) in enumerate(runs):
        spanned, spanned_lse = call(q[a:b], k[s:e], v[s:e], row.run_cu[i, 0], row.run_cu[i, 1], b - a, e - s, False)
        out[a:b] = merge_by_lse(out[a:b], lse[a:b], spanned, spanned_lse)
    return out[None]  # [1, T, H, D]
