"""Packed sequences: many prompts in one row with no padding, attention kept inside each prompt."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from models.attention_cpu import CPU_VARLEN, decode_attention_cpu, segment_attention_cpu, spanned_attention_cpu

# The attention implementation genscore installs: SDPA, plus a per-prompt path when a call is packed.
PACKED_ATTENTION = "genscore_packed_sdpa"
# Keyword of a packed call over past states (models/prefix.py): for each segment, the [start, end) of the past
# keys it reads, [n, 2]. Segments of several prefixes then share one call, each group reading only its own prefix.
PAST_SPANS = "past_spans"
# Keyword of a packed call: its PackedRow (the boundaries on host and device, the spans, the kernel to run).
PACKED_ROW = "packed_row"
# Keyword of a decode step through the CPU decode kernel (models/decoding.py): [B] int64, each row's real tokens, which
# are the last columns of its keys.
DECODE_LENGTHS = "decode_lengths"


class PackingUnsupported(RuntimeError):
    """An attention call carries something the per-prompt path cannot honour; such a model must not be packed."""


# Keyword arguments the per-prompt path honours: SDPA's own, and ones whose effect the mask already carries
# (a sliding window is part of the mask transformers builds) or that only describe the call.
_HONOURED = {"dropout", "scaling", "is_causal", "sliding_window", "position_ids", "cu_seq_lens_k",
             "max_length_q", "max_length_k", "output_attentions", "use_cache", PAST_SPANS}


def _unhonoured(kwargs: dict) -> list[str]:
    """The keyword arguments of an attention call that carry something neither the per-prompt path nor the kernels
    honour (sinks, soft-capping, ...), sorted."""
    return sorted(name for name, v in kwargs.items() if v is not None and name not in _HONOURED)


# Queries per attention call over a shared prefix's states: fewer calls against fewer keys per query. Tuned on CPU.
SUFFIX_GROUP_TOKENS = 256


@dataclass(frozen=True)
class PackedRow:
    """What every attention layer of one packed call needs to know about the row, built once per call: the segment
    boundaries on the host (so no layer reads them back from the device) and on the device (for a varlen kernel)."""

    bounds: tuple[int, ...]  # [n + 1] host: segment i is bounds[i]:bounds[i + 1] of the row
    cu_seqlens: torch.Tensor  # [n + 1] int32 on the model's device, the same boundaries
    max_length: int  # the longest segment
    spans: tuple[tuple[int, int], ...] | None = None  # per segment, the [start, end) of the past keys it reads
    kernel: str = "loop"  # the implementation of the one packed-attention op (segment_attention)
    # Whether the caller built the row's mask itself (models/prefix.py): then a segment with an empty span sees
    # exactly its own tokens causally, by construction, with no need to look at the mask on the device.
    own_mask: bool = False
    # Segments attend to their spans by cascade attention (models/cascade.py): the caller built no mask for the row.
    cascade: bool = False
    # For a kernel over spans (own_mask rows only): the key rows each segment reads, its span's then its own, back to
    # back, [sum of (span + length)] int64, and their boundaries [n + 1] int32, on the device; the longest.
    key_index: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_key_length: int = 0
    # For cascade attention on CUDA: per run of segments reading one span (models/cascade.py prefix_runs), its query
    # and key boundaries [[0, L], [0, span]], [runs, 2, 2] int32 on the device, uploaded once per call.
    run_cu: torch.Tensor | None = None

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]


LOOP = "loop"  # per-segment SDPA: the reference implementation, and the fallback


def packed_row(device: torch.device, kernel: str, lengths: Sequence[int],
               spans: Sequence[tuple[int, int]] | None = None, own_mask: bool = False, past: int = 0,
               cascade: bool = False) -> PackedRow:
    """The PackedRow of segments of `lengths` laid back to back, for a call on `device` through `kernel` (the plan's
    attention_kernel, models/plan.py); `past`: key rows before the row's own (a shared prefix's states), which spans
    may point into; `cascade`: the segments read their spans by cascade attention, with no mask (the plan's
    prefix_attention)."""
    bounds = [0, *packed_ends(lengths)]
    cu_seqlens = to_device(torch.tensor(bounds, dtype=torch.int32), device)
    spans = None if spans is None else tuple((int(s), int(e)) for s, e in spans)
    keys: dict = {}
    if spans is not None and own_mask and not cascade and kernel != LOOP and all(lengths):  # a kernel call has no empty segment
        index = [k for (s, e), a, b in zip(spans, bounds[:-1], bounds[1:])
                 for k in (*range(s, e), *range(past + a, past + b))]
        sizes = [e - s + b - a for (s, e), a, b in zip(spans, bounds[:-1], bounds[1:])]
        keys = {"key_index": to_device(torch.tensor(index, dtype=torch.long), device),
                "cu_seqlens_k": to_device(torch.tensor([0, *packed_ends(sizes)], dtype=torch.int32), device),
                "max_key_length": max(sizes, default=0)}
    if spans is not None and own_mask and cascade and device.type == "cuda":
        runs = [run for run in _groups(bounds, spans, bounds[-1]) if run[2] < run[3]]
        cu = torch.tensor([[[0, b - a], [0, e - s]] for a, b, s, e in runs], dtype=torch.int32).reshape(-1, 2, 2)
        keys["run_cu"] = to_device(cu, device)
    return PackedRow(tuple(bounds), cu_seqlens, max(lengths, default=0), spans, kernel, own_mask, cascade and own_mask,
                     **keys)


def packed_ends(lengths: Sequence[int]) -> list[int]:
    """Where each of segments of `lengths` laid back to back ends in the row."""
    ends, end = [], 0
    for length in lengths:
        end += length
        ends.append(end)
    return ends


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory without blocking, so the copy queues behind the work
    already in flight instead of waiting for it."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _causal_block(length: int, window: int | None, own_mask: bool) -> bool:
    """Whether a segment's diagonal block of the row's mask is plain causal attention, known on the host: the caller
    built the mask (own_mask) or the layer's sliding window covers the whole segment (every earlier token is in
    reach). Otherwise the block is used as the model built it."""
    return own_mask or (window is not None and length <= window)


def _groups(bounds: Sequence[int], spans: Sequence[tuple[int, int]], group_tokens: int
            ) -> list[tuple[int, int, int, int]]:
    """Consecutive segments [a, b) of the row that read the same past span [s, e), merged while a group spans at
    most group_tokens (a longer one alone): (a, b, s, e) per group."""
    groups: list[tuple[int, int, int, int]] = []
    for (a, b), span in zip(zip(bounds[:-1], bounds[1:]), spans):
        if a == b:
            continue  # an empty segment has no queries
        if groups and groups[-1][2:] == span and b - groups[-1][0] <= group_tokens:
            groups[-1] = (groups[-1][0], b, *span)
        else:
            groups.append((a, b, *span))
    return groups


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D] when packed
    key: torch.Tensor,  # [1, H_kv, past + T, D]: past = the states of a shared prefix, or none
    value: torch.Tensor,  # [1, H_kv, past + T, D]
    attention_mask: torch.Tensor | None,  # None or [1, 1, T, past + T], the mask for the whole row
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA; when the call is packed (PACKED_ROW, or `cu_seq_lens_q` alone: segment boundaries in the row), attention
    kept inside each segment.

    Without a past (packed prompts), each segment is one prompt, and the layer makes one call of the packed-attention
    op (segment_attention): per prompt, not one block-diagonal mask over the whole row (a mask would cost (sum of
    lengths)^2 attention work, per prompt it is the sum of squares, the same as unpacked prompts). Each prompt gets its
    diagonal block of the mask the model built for the row (so a sliding window, or any other pattern that depends
    only on the distance between tokens, is kept), or plain causal attention where the model built none or the block
    is causal.

    With a past (packed suffixes, models/prefix.py), the caller's mask says what each suffix token sees: its
    prefix's part of the past (all of it, unless the spans say which part) and its own suffix. Without a past,
    spans may point into the row itself: a prefix prefilled in the same call as its suffixes (its own span
    empty). Segments that read the same part are merged into groups of up to SUFFIX_GROUP_TOKENS queries, and a
    group attends to that part plus its own keys under its block of that mask, instead of every query to all
    past + T keys: the keys it skips are masked out for it anyway. Where the plan runs cascade attention (the row
    says so), the caller built no mask: models/cascade.py reads each span's keys in one non-causal call and each
    segment's own causally, merged by log-sum-exp.

    Anything else the layer passes (attention sinks, soft-capping, a non-causal layer) raises PackingUnsupported
    rather than being dropped.
    """
    boundaries = kwargs.pop("cu_seq_lens_q", None)
    row: PackedRow | None = kwargs.pop(PACKED_ROW, None)
    past_spans = kwargs.pop(PAST_SPANS, None)
    decode_lengths = kwargs.pop(DECODE_LENGTHS, None)
    if boundaries is None and row is None:
        out = None if decode_lengths is None else _decode_attention(module, query, key, value, decode_lengths, kwargs)
        if out is not None:
            return out, None
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    unknown = _unhonoured(kwargs)
    if unknown or not getattr(module, "is_causal", True):
        raise PackingUnsupported(f"attention layer {type(module).__name__} is called with "
                                 f"{unknown or ['is_causal=False']}")
    kwargs.pop("is_causal", None)
    past = key.shape[2] - query.shape[2]
    if row is None:  # a caller that passes the boundaries alone: read them here, once per layer
        bounds = boundaries.tolist()
        spans = None if past_spans is None else [tuple(s) for s in past_spans.tolist()]
        row = PackedRow(tuple(bounds), boundaries, max(b - a for a, b in zip(bounds[:-1], bounds[1:])), spans)
    spanned = past > 0 or row.spans is not None  # queries that also read keys outside their own segment
    groups = getattr(module, "num_key_value_groups", 1)
    if torch.compiler.is_compiling() and not spanned:
        # A compiled layer (models/compiled.py) calls one opaque op with the boundaries as a tensor: the row's host
        # list of them would make the graph guard on every batch's lengths.
        return packed_attention(query, key, value, attention_mask, boundaries, groups, kwargs.get("scaling"),
                                kwargs.get("dropout") or 0.0, kwargs.get("sliding_window"), row.kernel), None
    if not spanned:
        return segment_attention(query, key, value, attention_mask, row.cu_seqlens, list(row.bounds), row.max_length,
                                 groups, kwargs.get("scaling"), kwargs.get("sliding_window"), row.kernel), None
    if row.cascade:
        # no mask was built: the prefix's keys in one call per span, each segment's own causally, merged
        from models.cascade import cascade_attention

        return cascade_attention(row, query, key, value, groups, kwargs.get("scaling"), kwargs.get("sliding_window"),
                                 kwargs.get("dropout")), None
    if row.kernel == CPU_VARLEN and row.own_mask and row.spans is not None and kwargs.get("sliding_window") is None:
        # the caller's mask says exactly "its span, then its own tokens causally": the CPU kernel reads both in place
        out = spanned_attention_cpu(row, query, key, value, kwargs.get("scaling"))
        if out is not None:
            return out, None
    if row.key_index is not None:
        # the caller's mask says exactly "its span, then its own tokens causally": a kernel over gathered keys
        from models.attention_cuda import spanned_attention_fast

        out = spanned_attention_fast(row, query, key, value, groups, kwargs.get("scaling"))
        if out is not None:
            return out, None
    if attention_mask is None:
        raise PackingUnsupported("a packed call over past states or spans must carry the mask of what each token sees")
    parts = []
    spans = [(0, past)] * (len(row.bounds) - 1) if row.spans is None else row.spans
    for a, b, s, e in _groups(row.bounds, spans, SUFFIX_GROUP_TOKENS):
        own = slice(past + a, past + b)
        if s == e and _causal_block(b - a, None, row.own_mask):
            # a prefix of its own: the causal kernel over its own keys, no copies and no mask
            keys, values, block = key[:, :, own], value[:, :, own], None
        else:
            keys = torch.cat([key[:, :, s:e], key[:, :, own]], dim=2)  # [1, H_kv, e - s + L, D]
            values = torch.cat([value[:, :, s:e], value[:, :, own]], dim=2)
            block = torch.cat([attention_mask[:, :, a:b, s:e], attention_mask[:, :, a:b, own]], dim=-1)
        parts.append(sdpa_attention_forward(
            module, query[:, :, a:b], keys, values, block, is_causal=block is None, **kwargs
        )[0])  # [1, L, H, D]
    return torch.cat(parts, dim=1), None  # [1, T, H, D]


def _decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      lengths: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """A decode step's attention through the CPU kernel, each row's query [B, H, 1, D] against its own keys only:
    [B, 1, H, D]; None where the layer asks for more than plain attention over them (a window, dropout, soft-capping,
    sinks), which SDPA then runs under the model's mask."""
    if (_unhonoured(kwargs) or kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
            or kwargs.get("dropout") or not getattr(module, "is_causal", True)):
        return None
    return decode_attention_cpu(query, key, value, lengths, kwargs.get("scaling"))


@torch.library.custom_op("genscore::segment_attention", mutates_args=())
def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor, bounds: list[int], max_length: int, key_value_groups: int, scaling: float | None,
    window: int | None, kernel: str,
) -> torch.Tensor:
    """The one packed-attention op of a layer: causal attention inside each segment of a packed row, [1, T, H, D].

    One op, several implementations, the same numbers: `kernel` names one the load-time self-check proved for the
    model (models/attention_cuda.py on a GPU, models/attention_cpu.py on a CPU); any call it cannot honour, and
    LOOP, run one SDPA call per segment.
    query [1, H, T, D]; key, value [1, H_kv, T, D]; attention_mask None or the row's [1, 1, T, T]; cu_seqlens the
    boundaries on the device, bounds the same on the host; window the layer's sliding window, if any.
    """
    layer = _AttentionLayer(key_value_groups)
    out = None
    if kernel == CPU_VARLEN:
        served = segment_attention_cpu(query, key, value, attention_mask, cu_seqlens, bounds, scaling, window)
        if served is not None:
            out, longer = served  # [1, T, H, D]
            for a, b in longer:  # the segments it leaves: SDPA per segment, as each would run alone
                out[:, a:b] = _segment_sdpa(layer, query, key, value, attention_mask, a, b, scaling, window)
            return out
    elif kernel != LOOP:
        from models.attention_cuda import segment_attention_fast

        out = segment_attention_fast(kernel, query, key, value, attention_mask, cu_seqlens, max_length,
                                     key_value_groups, scaling, window)
    if out is not None:
        return out
    parts = [_segment_sdpa(layer, query, key, value, attention_mask, a, b, scaling, window)
             for a, b in zip(bounds[:-1], bounds[1:])]  # each [1, L, H, D]
    return torch.cat(parts, dim=1)  # [1, T, H, D]


def _segment_sdpa(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, a: int, b: int, scaling: float | None, window: int | None
                  ) -> torch.Tensor:
    """One SDPA call over segment [a, b) of the row, under its diagonal block of the row's mask: [1, L, H, D]."""
    block = None if attention_mask is None else attention_mask[:, :, a:b, a:b]  # [1, 1, L, L]
    if block is not None and _causal_block(b - a, window, False):
        block = None  # causal after all: SDPA's causal kernel, the one an unpacked prompt runs
    return sdpa_attention_forward(
        layer, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], block, is_causal=block is None,
        scaling=scaling, dropout=0.0,
    )[0]


@segment_attention.register_fake
def _(query, key, value, attention_mask, cu_seqlens, bounds, max_length, key_value_groups, scaling, window, kernel):
    batch, heads, tokens, dim = query.shape
    return query.new_empty((batch, tokens, heads, dim))


@dataclass(frozen=True)
class _AttentionLayer:
    """What sdpa_attention_forward reads of an attention module, for calls made outside one."""

    num_key_value_groups: int
    is_causal: bool = True
    training: bool = False


@torch.library.custom_op("genscore::packed_attention", mutates_args=())
def packed_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    boundaries: torch.Tensor, key_value_groups: int, scaling: float | None, dropout: float, window: int | None,
    kernel: str,
) -> torch.Tensor:
    """segment_attention over prompts packed without a past, for a compiled layer: the boundaries come as one host
    tensor [n + 1] (a list of ints would make the graph guard on every batch's lengths), [1, T, H, D]."""
    if dropout:
        return packed_sdpa_attention(_AttentionLayer(key_value_groups), query, key, value, attention_mask,
                                     cu_seq_lens_q=boundaries, scaling=scaling, dropout=dropout)[0]
    bounds = boundaries.tolist()
    row = packed_row(query.device, kernel, [b - a for a, b in zip(bounds[:-1], bounds[1:])])
    return segment_attention(query, key, value, attention_mask, row.cu_seqlens, list(row.bounds), row.max_length,
                             key_value_groups, scaling, window, kernel)


@packed_attention.register_fake
def _(query, key, value, attention_mask, boundaries, key_value_groups, scaling, dropout, window, kernel
      ) -> torch.Tensor:
    batch, heads, tokens, dim = query.shape
    return query.new_empty((batch, tokens, heads, dim))


# Set while a packed row runs whose padding mask is all ones by construction (models/forward.py, models/cuda_graphs.py).
_NO_PADDING: ContextVar[bool] = ContextVar("genscore_no_padding", default=False)


@contextmanager
def no_padding() -> Iterator[None]:
    """Within: the model's padding masks hold no padding, so masks are built without reading them on the device."""
    token = _NO_PADDING.set(True)
    try:
        yield
    finally:
        _NO_PADDING.reset(token)


def packed_mask(*args, **kwargs):
    """SDPA's mask; inside no_padding() built as without a padding mask (the same mask), so that transformers does
    not ask the device whether the mask is all ones: no host sync, and nothing a CUDA graph capture refuses."""
    if _NO_PADDING.get() and "attention_mask" in kwargs:
        kwargs["attention_mask"] = None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
# Unpacked calls (padded batches, key/value caches) build the same masks SDPA would.
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, packed_mask)


def use_packed_attention(model: PreTrainedModel) -> bool:
    """Switch an SDPA model to the packing-aware implementation (same numbers unpacked); False if it is not SDPA.

    Whether calls are then packed is the plan's decision (models/plan.py layout), made by the self-check."""
    if model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(PACKED_ATTENTION)
    return True


def pack(sequences: Sequence[Sequence[int]], device: torch.device):
    """One row holding every sequence back to back: ids, position ids [1, T] on `device`, and prompt boundaries
    [n + 1] on the host (as a tensor, for callers that pass `cu_seq_lens_q`)."""
    bounds = [0, *packed_ends([len(seq) for seq in sequences])]
    # Built as Python lists and copied once each: no host-side ops per token, one upload per tensor.
    input_ids = torch.tensor([token for seq in sequences for token in seq], dtype=torch.long)[None]  # [1, T]
    # Positions restart at 0 for each prompt, so each sees exactly the positions it would see alone.
    position_ids = torch.tensor([i for seq in sequences for i in range(len(seq))], dtype=torch.long)[None]  # [1, T]
    return to_device(input_ids, device), to_device(position_ids, device), torch.tensor(bounds, dtype=torch.long)
