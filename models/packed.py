"""Packed sequences: many prompts in one row with no padding, attention kept inside each prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

# The attention implementation genscore installs: SDPA, plus a per-prompt path when a call is packed.
PACKED_ATTENTION = "genscore_packed_sdpa"
# Keyword of a packed call over past states (models/prefix.py): for each segment, the [start, end) of the past
# keys it reads, [n, 2]. Segments of several prefixes then share one call, each group reading only its own prefix.
PAST_SPANS = "past_spans"


class PackingUnsupported(RuntimeError):
    """An attention call carries something the per-prompt path cannot honour; such a model must not be packed."""


# Keyword arguments the per-prompt path honours: SDPA's own, and ones whose effect the mask already carries
# (a sliding window is part of the mask transformers builds) or that only describe the call.
_HONOURED = {"dropout", "scaling", "is_causal", "sliding_window", "position_ids", "cu_seq_lens_k",
             "max_length_q", "max_length_k", "output_attentions", "use_cache", PAST_SPANS}


# Queries per attention call over a shared prefix's states: fewer calls against fewer keys per query. Tuned on CPU.
SUFFIX_GROUP_TOKENS = 256


def _is_causal(block: torch.Tensor) -> bool:
    """Whether a [1, 1, L, L] mask block is exactly the boolean causal mask."""
    length = block.shape[-1]
    return (block.dtype == torch.bool and block.shape[1] == 1 and block.shape[-2] == length
            and torch.equal(block[0, 0], torch.ones(length, length, dtype=torch.bool, device=block.device).tril_()))


def _groups(bounds: list[int], spans: list[tuple[int, int]], group_tokens: int) -> list[tuple[int, int, int, int]]:
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
    """SDPA; when the call carries `cu_seq_lens_q` (segment boundaries in the packed row), SDPA per segment.

    Without a past (packed prompts), each segment is one prompt. Per prompt, not one block-diagonal mask over
    the whole row: a mask would cost (sum of lengths)^2 attention work, per prompt it is the sum of squares, the
    same as unpacked prompts. Each prompt gets its diagonal block of the mask the model built for the row (so
    a sliding window, or any other pattern that depends only on the distance between tokens, is kept), or plain
    causal attention where the model built none or the block is causal.

    With a past (packed suffixes, models/prefix.py), the caller's mask says what each suffix token sees: its
    prefix's part of the past (all of it, unless PAST_SPANS says which part) and its own suffix. Without a past,
    PAST_SPANS may point into the row itself: a prefix prefilled in the same call as its suffixes (its own span
    empty). Segments that read the same part are merged into groups of up to SUFFIX_GROUP_TOKENS queries, and a
    group attends to that part plus its own keys under its block of that mask, instead of every query to all
    past + T keys: the keys it skips are masked out for it anyway.

    Anything else the layer passes (attention sinks, soft-capping, a non-causal layer) raises PackingUnsupported
    rather than being dropped.
    """
    boundaries = kwargs.pop("cu_seq_lens_q", None)
    past_spans = kwargs.pop(PAST_SPANS, None)
    if boundaries is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    unknown = sorted(name for name, v in kwargs.items() if v is not None and name not in _HONOURED)
    if unknown or not getattr(module, "is_causal", True):
        raise PackingUnsupported(f"attention layer {type(module).__name__} is called with "
                                 f"{unknown or ['is_causal=False']}")
    kwargs.pop("is_causal", None)
    past = key.shape[2] - query.shape[2]
    spanned = past > 0 or past_spans is not None  # queries that also read keys outside their own segment
    if torch.compiler.is_compiling() and not spanned:
        # A compiled layer (models/compiled.py) calls the per-prompt loop below as one opaque op: its Python
        # loop over boundaries would otherwise break the graph in every layer.
        groups = getattr(module, "num_key_value_groups", 1)
        return packed_attention(query, key, value, attention_mask, boundaries, groups,
                                kwargs.get("scaling"), kwargs.get("dropout") or 0.0), None
    if spanned and attention_mask is None:
        raise PackingUnsupported("a packed call over past states or spans must carry the mask of what each token sees")
    bounds = boundaries.tolist()
    parts = []
    if spanned:
        spans = [(0, past)] * (len(bounds) - 1) if past_spans is None else [tuple(s) for s in past_spans.tolist()]
        for a, b, s, e in _groups(bounds, spans, SUFFIX_GROUP_TOKENS):
            own = slice(past + a, past + b)
            keys = torch.cat([key[:, :, s:e], key[:, :, own]], dim=2)  # [1, H_kv, e - s + L, D]
            values = torch.cat([value[:, :, s:e], value[:, :, own]], dim=2)
            block = torch.cat([attention_mask[:, :, a:b, s:e], attention_mask[:, :, a:b, own]], dim=-1)
            block = None if s == e and _is_causal(block) else block  # a prefix of its own: the causal kernel
            parts.append(sdpa_attention_forward(
                module, query[:, :, a:b], keys, values, block, is_causal=block is None, **kwargs
            )[0])  # [1, L, H, D]
        return torch.cat(parts, dim=1), None  # [1, T, H, D]
    for a, b in zip(bounds[:-1], bounds[1:]):
        block = None if attention_mask is None else attention_mask[:, :, a:b, a:b]  # [1, 1, L, L]
        if block is not None and _is_causal(block):
            block = None  # causal after all: SDPA's causal kernel, the one an unpacked prompt runs
        parts.append(sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], block, is_causal=block is None, **kwargs
        )[0])  # [1, L, H, D]
    return torch.cat(parts, dim=1), None  # [1, T, H, D]


@dataclass(frozen=True)
class _AttentionLayer:
    """What sdpa_attention_forward reads of an attention module, for calls made outside one."""

    num_key_value_groups: int
    is_causal: bool = True
    training: bool = False


@torch.library.custom_op("genscore::packed_attention", mutates_args=())
def packed_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    boundaries: torch.Tensor, key_value_groups: int, scaling: float | None, dropout: float,
) -> torch.Tensor:
    """packed_sdpa_attention over prompts packed without a past, as one op: [1, T, H, D]."""
    return packed_sdpa_attention(_AttentionLayer(key_value_groups), query, key, value, attention_mask,
                                 cu_seq_lens_q=boundaries, scaling=scaling, dropout=dropout)[0]


@packed_attention.register_fake
def _(query, key, value, attention_mask, boundaries, key_value_groups, scaling, dropout) -> torch.Tensor:
    batch, heads, tokens, dim = query.shape
    return query.new_empty((batch, tokens, heads, dim))


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
# Unpacked calls (padded batches, key/value caches) build the same masks SDPA would.
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, sdpa_mask)


def use_packed_attention(model: PreTrainedModel) -> bool:
    """Switch an SDPA model to the packing-aware implementation (same numbers unpacked); False if it is not SDPA.

    Whether calls are then packed is the plan's decision (models/plan.py layout), made by the self-check."""
    if model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(PACKED_ATTENTION)
    return True


def pack(sequences: list[list[int]], device: torch.device):
    """One row holding every sequence back to back: ids, position ids [1, T] and prompt boundaries [n + 1]."""
    lengths = torch.tensor([len(seq) for seq in sequences], dtype=torch.long)
    boundaries = torch.zeros(len(sequences) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=boundaries[1:])
    input_ids = torch.tensor([token for seq in sequences for token in seq], dtype=torch.long)[None]
    # Positions restart at 0 for each prompt, so each sees exactly the positions it would see alone.
    starts = torch.repeat_interleave(boundaries[:-1], lengths)
    position_ids = (torch.arange(input_ids.shape[1]) - starts)[None]
    return input_ids.to(device), position_ids.to(device), boundaries
