"""Shared-prefix forward passes: prefill a prefix once, keep its key/value states, and run many suffixes over them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from models.body import cache_kwarg
from models.forward import pack_tokens, pad_left, plan_packs
from models.packed import PACKED_ATTENTION, PACKED_ROW, PAST_SPANS, pack, packed_ends, packed_row, to_device
from models.plan import ForwardPlan

# On a batch-invariant model a suffix is right-padded to a multiple of this many tokens and batched only with
# suffixes of the same prefix and padded width, so the shape its attention and linears see is its own.
SUFFIX_BUCKET_TOKENS = 16
# Attention implementations that read a boolean 4D mask as given (True: attend), which packed suffixes need.
_BOOLEAN_MASK_ATTENTION = ("sdpa", PACKED_ATTENTION)


@dataclass(frozen=True)
class PrefixState:
    """What a prefix leaves behind: per-layer keys and values, each [1, H, P, D], and the hidden state of its last token."""

    tokens: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    last_hidden: torch.Tensor  # [hidden]: the logits of the token after the prefix come from it

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, self.last_hidden)
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class SuffixRow:
    """One sequence = prefix + suffix; `keep` is how many of its last positions to return hidden states for.

    keep may be len(suffix) + 1: the extra position is the prefix's last token (whose hidden
    state the prefix already holds), which predicts the suffix's first token.
    """

    prefix: PrefixState
    suffix: tuple[int, ...]
    keep: int = 1


class _PrefixLayer(DynamicLayer):
    """A read-only cache layer: attention sees the prefix states of each row, but nothing is appended.

    Storing the grown states would keep every layer's [B, H, P + S, D] alive for the whole pass;
    returning the concatenation instead frees it after the layer, as a cache-free pass does.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, row_prefix: torch.Tensor | None):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values  # [G, H, P, D]: the distinct prefixes, left-padded to P
        self._row_prefix = row_prefix  # [B]: which prefix each row reads; None when G == 1

    def _rows(self, states: torch.Tensor, batch: int) -> torch.Tensor:
        if self._row_prefix is None:
            return states.expand(batch, -1, -1, -1)  # a view: no copy of the shared prefix
        return states.index_select(0, self._row_prefix)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        batch = key_states.shape[0]
        keys = torch.cat([self._rows(self.keys, batch), key_states], dim=-2)  # [B, H, P + S, D]
        values = torch.cat([self._rows(self.values, batch), value_states], dim=-2)
        return keys, values


def supports_prefix_reuse(model: PreTrainedModel) -> bool:
    """True when the model's cache is plain full attention (no sliding window, no linear or recurrent layers).

    Other caches drop or transform states in ways a shared read-only prefix cannot reproduce,
    so those models score every sequence from scratch.
    """
    if getattr(model.config, "is_encoder_decoder", False):
        return False
    try:
        cache = DynamicCache(config=model.config)
    except Exception:  # noqa: BLE001 - an exotic config simply opts out
        return False
    return all(type(layer) is DynamicLayer for layer in cache.layers)


class _Segments:
    """Segments laid back to back in a packed row, and the keys each one reads besides its own."""

    def __init__(self, lengths: Sequence[int], spans: Sequence[tuple[int, int]], first_positions: Sequence[int]):
        self.lengths = list(lengths)
        self.spans = torch.tensor(spans, dtype=torch.long).reshape(-1, 2)  # [n, 2]: [start, end) of the keys it reads
        sizes = torch.tensor(self.lengths, dtype=torch.long)
        self.owner = torch.repeat_interleave(torch.arange(len(sizes)), sizes)  # [T]: each token's segment
        starts = torch.cumsum(sizes, 0) - sizes
        self.offsets = torch.arange(len(self.owner)) - torch.repeat_interleave(starts, sizes)  # [T]: place in segment
        self.positions = self.offsets + torch.tensor(first_positions, dtype=torch.long)[self.owner]  # [T]

    def mask(self, past: int) -> torch.Tensor:
        """What each token sees, [T, past + T]: the keys of its segment's span, and its own segment up to itself
        (the row's tokens come after `past` key columns of states)."""
        total = len(self.owner)
        columns = torch.arange(past + total)[None]  # [1, past + T]
        sees = (columns >= self.spans[self.owner, :1]) & (columns < self.spans[self.owner, 1:])  # [T, past + T]
        sees[:, past:] |= (self.owner[:, None] == self.owner[None, :]) & (self.offsets[None, :] <= self.offsets[:, None])
        return sees

    @property
    def boundaries(self) -> torch.Tensor:
        return torch.cumsum(torch.tensor([0, *self.lengths]), 0)  # [n + 1]


@torch.inference_mode()
def prefill_prefixes(model: PreTrainedModel, plan: ForwardPlan, prefixes: Sequence[Sequence[int]], pad_token_id: int) -> list[PrefixState]:
    """Run each prefix once and keep its key/value states and last hidden state: packed back to back in one call
    where the model packs (models/packed.py), else left-padded together (alone on a batch-invariant model, where
    the padding would change the order attention sums in)."""
    if plan.prefix_reuse == "whole_cache":
        from models.cache_reuse import prefill_whole  # it builds on this module's rows

        return [prefill_whole(plan, prefix, model.device) for prefix in prefixes]
    if plan.batch_invariant and len(prefixes) > 1:
        return [state for prefix in prefixes for state in prefill_prefixes(model, plan, [prefix], pad_token_id)]
    device = model.device
    cache = DynamicCache(config=model.config)
    if plan.layout == "packed":
        input_ids, position_ids, boundaries = pack(prefixes, device)
        hidden = plan.body(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), position_ids=position_ids,
            use_cache=True, cu_seq_lens_q=boundaries, **{cache_kwarg(plan.body): cache},
            **{PACKED_ROW: packed_row(device, plan.attention_kernel, [len(prefix) for prefix in prefixes])},
        ).last_hidden_state[0]  # [sum of lengths, H]
        ends = packed_ends([len(prefix) for prefix in prefixes])
        spans = list(zip([0, *ends[:-1]], ends))  # each prefix's [start, end)
        return [_kept_prefix(tokens, cache, 0, start, end, hidden[end - 1]) for tokens, (start, end) in zip(prefixes, spans)]
    input_ids, attention_mask, position_ids = pad_left(prefixes, pad_token_id, device)
    hidden = plan.body(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        use_cache=True, **{cache_kwarg(plan.body): cache},
    ).last_hidden_state  # [G, T, H]
    width = input_ids.shape[1]
    # each row's real tokens sit at its right end
    return [_kept_prefix(tokens, cache, row, width - len(tokens), width, hidden[row, -1]) for row, tokens in enumerate(prefixes)]


@torch.inference_mode()
def prefill_with_suffixes(model: PreTrainedModel, plan: ForwardPlan, prefixes: Sequence[Sequence[int]],
                          rows: Sequence[tuple[int, Sequence[int], int]], pad_token_id: int
                          ) -> tuple[list[PrefixState], torch.Tensor]:
    """Prefill `prefixes` and run the suffixes that hang off them: the prefixes' states, and the kept hidden states
    of each (prefix index, suffix, keep) row, row after row, [sum keep, H], as forward_suffixes over those states.

    Where suffixes run packed (plan.packed_suffixes), a prefix and the suffixes that fit after it in pack_tokens(model)
    run in the same call (_prefix_and_suffixes_pass), one model call instead of two; the rest run over its states. A
    prefix after which none fits (a query longer than a call) is prefilled alone, without the mask a shared call
    needs.
    """
    if not plan.packed_suffixes or plan.batch_invariant or plan.layout != "packed":
        states = prefill_prefixes(model, plan, prefixes, pad_token_id)
        return states, forward_suffixes(model, plan, [SuffixRow(states[p], tuple(s), k) for p, s, k in rows], pad_token_id)
    for _, suffix, keep in rows:
        _check_keep(len(suffix), keep)
    budget = pack_tokens(model)
    along: list[list[int]] = [[] for _ in prefixes]  # per prefix: the rows that run in its call
    later: list[int] = []  # rows that do not fit after their prefix: they run over its states
    sizes = [len(prefix) for prefix in prefixes]  # per prefix: tokens of its call's share
    for i, (p, suffix, _) in enumerate(rows):
        if sizes[p] + len(suffix) <= budget:
            along[p].append(i)
            sizes[p] += len(suffix)
        else:
            later.append(i)
    states: list[PrefixState | None] = [None] * len(prefixes)
    blocks: list[torch.Tensor | None] = [None] * len(rows)
    bare = [p for p in range(len(prefixes)) if not along[p]]  # no suffix fits after it: a plain prefill, no mask
    if bare:
        for p, state in zip(bare, prefill_prefixes(model, plan, [prefixes[p] for p in bare], pad_token_id)):
            states[p] = state
    dressed = [p for p in range(len(prefixes)) if along[p]]
    for call in plan_packs([sizes[p] for p in dressed], budget):
        call = [dressed[c] for c in call]
        called = _prefix_and_suffixes_pass(model, plan, [prefixes[p] for p in call], [[rows[i] for i in along[p]] for p in call])
        for p, (state, hidden) in zip(call, called):
            states[p] = state
            for i, block in zip(along[p], hidden.split([rows[i][2] for i in along[p]])):
                blocks[i] = block
    if later:
        hidden = forward_suffixes(model, plan, [SuffixRow(states[rows[i][0]], tuple(rows[i][1]), rows[i][2]) for i in later],
                                  pad_token_id)
        for i, block in zip(later, hidden.split([rows[i][2] for i in later])):
            blocks[i] = block
    return states, torch.cat(blocks) if blocks else torch.empty(0)


def _prefix_and_suffixes_pass(model: PreTrainedModel, plan: ForwardPlan, prefixes: Sequence[Sequence[int]],
                              suffixes: Sequence[Sequence[tuple[int, Sequence[int], int]]]
                              ) -> list[tuple[PrefixState, torch.Tensor]]:
    """Prefixes and their suffixes (each (_, suffix, keep)) in one packed call, each prefix followed by its suffixes:
    per prefix its states and its suffixes' kept hidden states, [sum keep, H].

    A prefix attends to itself causally, as alone; each suffix to its prefix and to itself up to each token, at the
    positions it has in a plain pass of prefix + suffix: the mask says so, and PAST_SPANS points each suffix's
    queries at its prefix's keys in the row (models/packed.py).
    """
    lengths, spans, positions = [], [], []  # per segment of the row: tokens, the row keys it reads, first position
    tokens: list[int] = []
    for prefix, rows in zip(prefixes, suffixes):
        start = len(tokens)
        lengths.append(len(prefix))
        spans.append((0, 0))
        positions.append(0)
        tokens += prefix
        for _, suffix, _ in rows:
            lengths.append(len(suffix))
            spans.append((start, start + len(prefix)))
            positions.append(len(prefix))
            tokens += suffix
    segments = _Segments(lengths, spans, positions)
    device = model.device
    cache = DynamicCache(config=model.config)
    cascade = plan.prefix_attention == "cascade"
    hidden = plan.body(
        input_ids=to_device(torch.tensor(tokens, dtype=torch.long)[None], device),
        attention_mask=_unread_mask(len(tokens), 0, device) if cascade else to_device(segments.mask(0)[None, None], device),
        position_ids=to_device(segments.positions[None], device),
        use_cache=True, cu_seq_lens_q=segments.boundaries, **{PAST_SPANS: segments.spans},
        **{PACKED_ROW: packed_row(device, plan.attention_kernel, lengths, spans, own_mask=True, cascade=cascade)},
        **{cache_kwarg(plan.body): cache},
    ).last_hidden_state[0]  # [T, H]
    bounds = [0, *packed_ends(lengths)]  # segment i is bounds[i]:bounds[i + 1]
    out = []
    segment = 0  # the prefix's segment; its suffixes' follow it
    for prefix, rows in zip(prefixes, suffixes):
        end = bounds[segment + 1]
        state = _kept_prefix(prefix, cache, 0, bounds[segment], end, hidden[end - 1])
        suffix_states = [hidden[bounds[segment + 1 + j] : bounds[segment + 2 + j]] for j in range(len(rows))]
        kept = _kept_states([SuffixRow(state, tuple(s), k) for _, s, k in rows], suffix_states) if rows else hidden[:0]
        out.append((state, kept))
        segment += 1 + len(rows)
    return out


def _kept_prefix(tokens: Sequence[int], cache: DynamicCache, row: int, start: int, end: int,
                 last_hidden: torch.Tensor) -> PrefixState:
    """One prefix's states, copied out of a prefill's cache: its row, columns [start, end) of every layer."""
    keys = tuple(layer.keys[row : row + 1, :, start:end, :].clone() for layer in cache.layers)  # [1, H, P, D]
    values = tuple(layer.values[row : row + 1, :, start:end, :].clone() for layer in cache.layers)
    return PrefixState(tuple(tokens), keys, values, last_hidden.clone())


def _stack_prefixes(states: Sequence[PrefixState], layer: int, pick) -> torch.Tensor:
    """The distinct prefixes of one layer, left-padded to the longest: [G, H, P, D]."""
    tensors = [pick(state)[layer] for state in states]
    longest = max(t.shape[-2] for t in tensors)
    if len(tensors) == 1:
        return tensors[0]
    out = tensors[0].new_zeros((len(tensors), tensors[0].shape[1], longest, tensors[0].shape[3]))
    for g, t in enumerate(tensors):
        out[g, :, longest - t.shape[-2] :, :] = t[0]
    return out


def can_pack_suffixes(model: PreTrainedModel) -> bool:
    """Whether the model's attention reads the boolean mask packed suffixes pass (SDPA reads it as given)."""
    return model.config._attn_implementation in _BOOLEAN_MASK_ATTENTION


def _check_keep(suffix_length: int, keep: int) -> None:
    if not 1 <= keep <= suffix_length + 1:
        raise ValueError(f"keep must be in [1, len(suffix) + 1], got {keep} for {suffix_length} tokens")


@torch.inference_mode()
def forward_suffixes(model: PreTrainedModel, plan: ForwardPlan, rows: Sequence[SuffixRow], pad_token_id: int) -> torch.Tensor:
    """Hidden states of the kept positions of every row, stacked row after row, oldest first: [N, H].

    Rows may hang off different prefixes. Packed (plan.packed_suffixes): the suffixes of one prefix lie back to back
    in one sequence after it (_packed_suffix_pass). Otherwise one row per suffix: prefixes are left-padded to the
    longest (padding masked out); suffixes are right-padded after them, so a real token never sees a pad and
    its position id is simply prefix length + offset, the position it has in a plain pass.
    On a batch-invariant model rows are grouped by prefix and by suffix length rounded up to
    SUFFIX_BUCKET_TOKENS, and each group runs at exactly that width: no row's layout depends on another's.
    """
    for row in rows:
        _check_keep(len(row.suffix), row.keep)
    if plan.prefix_reuse == "whole_cache":
        from models.cache_reuse import suffix_hidden  # it builds on this module's rows

        return _kept_states(rows, [suffix_hidden(plan, row.prefix, row.suffix, model.device) for row in rows])
    if not plan.batch_invariant:
        if plan.packed_suffixes:
            return _packed_suffixes(model, plan, rows)
        return _suffix_pass(model, plan, rows, pad_token_id)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, row in enumerate(rows):
        width = -(-len(row.suffix) // SUFFIX_BUCKET_TOKENS) * SUFFIX_BUCKET_TOKENS
        groups.setdefault((id(row.prefix), width), []).append(i)
    blocks: list[torch.Tensor | None] = [None] * len(rows)
    for (_, width), members in groups.items():
        hidden = _suffix_pass(model, plan, [rows[i] for i in members], pad_token_id, width)  # [sum of keep, H]
        for i, block in zip(members, hidden.split([rows[i].keep for i in members])):
            blocks[i] = block
    return torch.cat(blocks)


def _suffix_pass(model: PreTrainedModel, plan: ForwardPlan, rows: Sequence[SuffixRow], pad_token_id: int,
                 suffix_width: int | None = None) -> torch.Tensor:
    """forward_suffixes in one model call, suffixes right-padded to suffix_width (default: the longest)."""
    device = model.device
    distinct: dict[int, int] = {}
    prefixes: list[PrefixState] = []
    for row in rows:
        if id(row.prefix) not in distinct:
            distinct[id(row.prefix)] = len(prefixes)
            prefixes.append(row.prefix)
    prefix_width = max(p.length for p in prefixes)
    if suffix_width is None:
        suffix_width = max(len(row.suffix) for row in rows)

    hidden = None
    if suffix_width > 0:
        batch = len(rows)
        input_ids = torch.full((batch, suffix_width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, prefix_width + suffix_width), dtype=torch.long)
        position_ids = torch.zeros((batch, suffix_width), dtype=torch.long)
        for b, row in enumerate(rows):
            n = len(row.suffix)
            if n:
                input_ids[b, :n] = torch.tensor(row.suffix, dtype=torch.long)
            attention_mask[b, prefix_width - row.prefix.length : prefix_width + n] = 1
            position_ids[b] = torch.arange(row.prefix.length, row.prefix.length + suffix_width)
        row_prefix = None
        if len(prefixes) > 1:
            row_prefix = torch.tensor([distinct[id(row.prefix)] for row in rows], dtype=torch.long, device=device)
        n_layers = len(prefixes[0].keys)
        cache = DynamicCache(config=model.config)
        cache.layers = [
            _PrefixLayer(_stack_prefixes(prefixes, i, lambda s: s.keys),
                         _stack_prefixes(prefixes, i, lambda s: s.values), row_prefix)
            for i in range(n_layers)
        ]
        hidden = plan.body(
            input_ids=to_device(input_ids, device), attention_mask=to_device(attention_mask, device),
            position_ids=to_device(position_ids, device), use_cache=True, **{cache_kwarg(plan.body): cache},
        ).last_hidden_state  # [B, S, H]

    return _kept_states(rows, [None if hidden is None else hidden[b, : len(row.suffix)] for b, row in enumerate(rows)])


def _kept_states(rows: Sequence[SuffixRow], suffix_states: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Each row's kept positions, row after row: [sum keep, H]. suffix_states[i] holds row i's suffix positions,
    [len(suffix), H] (None when no row has a suffix); a row keeping len(suffix) + 1 also takes its prefix's last."""
    picked = []
    for row, states in zip(rows, suffix_states):
        n = len(row.suffix)
        if row.keep == n + 1:
            picked.append(row.prefix.last_hidden[None])  # [1, H]: the prefix's own last position
        from_suffix = min(row.keep, n)
        if from_suffix:
            picked.append(states[n - from_suffix :])  # [k, H]
    return torch.cat(picked, dim=0)


def _packed_suffixes(model: PreTrainedModel, plan: ForwardPlan, rows: Sequence[SuffixRow]) -> torch.Tensor:
    """forward_suffixes packed: rows grouped by prefix, in calls of up to pack_tokens(model) suffix tokens each. A
    call may hold the suffixes of several prefixes (the queries of a batch share its linears)."""
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(id(row.prefix), []).append(i)
    order = [i for members in groups.values() for i in members]  # each prefix's rows together, in first-seen order
    blocks: list[torch.Tensor | None] = [None] * len(rows)
    for call in plan_packs([len(rows[i].suffix) for i in order], pack_tokens(model)):
        call = [order[c] for c in call]
        hidden = _packed_suffix_pass(model, plan, [rows[i] for i in call])
        for i, block in zip(call, hidden.split([rows[i].keep for i in call])):
            blocks[i] = block
    return torch.cat(blocks)


def _packed_suffix_pass(model: PreTrainedModel, plan: ForwardPlan, rows: Sequence[SuffixRow]) -> torch.Tensor:
    """Rows in one model call, those of one prefix next to each other: their suffixes back to back after the states
    of their prefixes (laid one after another), [sum keep, H].

    Each suffix token attends to its own prefix and to its own suffix up to itself, never to another suffix or
    prefix: exactly what it sees in a plain pass of prefix + suffix, at the same position ids. Unlike one padded
    row per suffix, no pad token is computed and each prefix's states are read once, not copied into every row.
    """
    device = model.device
    starts: dict[int, int] = {}  # id(prefix) -> where its states start in the call's past
    prefixes: list[PrefixState] = []
    for row in rows:
        if id(row.prefix) not in starts:
            starts[id(row.prefix)] = sum(p.length for p in prefixes)
            prefixes.append(row.prefix)
    past = sum(p.length for p in prefixes)
    lengths = [len(row.suffix) for row in rows]
    total = sum(lengths)
    hidden = None
    if total:
        spans = [(starts[id(row.prefix)], starts[id(row.prefix)] + row.prefix.length) for row in rows]
        segments = _Segments(lengths, spans, [row.prefix.length for row in rows])
        input_ids = torch.tensor([token for row in rows for token in row.suffix], dtype=torch.long)[None]  # [1, T]
        cache = DynamicCache(config=model.config)
        cache.layers = [
            _PrefixLayer(_concat_prefixes(prefixes, i, lambda s: s.keys),
                         _concat_prefixes(prefixes, i, lambda s: s.values), None)
            for i in range(len(prefixes[0].keys))
        ]
        packing = {}
        cascade = plan.layout == "packed" and plan.prefix_attention == "cascade"
        if plan.layout == "packed":
            # Suffix boundaries let packed attention skip the keys of other suffixes and prefixes (models/packed.py).
            packing = {"cu_seq_lens_q": segments.boundaries, PAST_SPANS: segments.spans,
                       PACKED_ROW: packed_row(device, plan.attention_kernel, lengths, spans, own_mask=True, past=past,
                                              cascade=cascade)}
        mask = _unread_mask(total, past, device) if cascade else to_device(segments.mask(past)[None, None], device)
        hidden = plan.body(
            input_ids=to_device(input_ids, device),
            attention_mask=mask,  # [1, 1, T, past + T]
            position_ids=to_device(segments.positions[None], device), use_cache=True,
            **{cache_kwarg(plan.body): cache}, **packing,
        ).last_hidden_state[0]  # [T, H]
    return _kept_states(rows, [None] * len(rows) if hidden is None else hidden.split(lengths))


def _unread_mask(tokens: int, past: int, device: torch.device) -> torch.Tensor:
    """The attention mask of a cascade call, [1, 1, T, past + T]: cascade attention (models/cascade.py) reads no
    mask, but a 4D one keeps transformers from building its own for the row. A broadcast view of one element: no
    T x (past + T) tensor is built. Nothing reads it: a cascade call that cannot run raises instead of falling
    back to masked attention."""
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device).expand(1, 1, tokens, past + tokens)


def _concat_prefixes(states: Sequence[PrefixState], layer: int, pick) -> torch.Tensor:
    """The prefixes of one layer one after another along the sequence: [1, H, sum of lengths, D]."""
    tensors = [pick(state)[layer] for state in states]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-2)
