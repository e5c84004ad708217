"""Incremental decoding primitives: prefill, one decode step, and the batch surgery (select rows, merge two batches,
trim shared left padding) that lets sequences join and leave between steps.

Batched decoding (plan.decoding == "batched", proven at load for models whose cache is keys and values only): the
running batch is a key/value cache written in place (models/kv_buffer.py: per layer, buffers with room for every
row's final length, so a step writes one column instead of copying the cache) whose rows are left-padded to a common
length T, plus a 2D attention mask [B, T] (1 = real token). Positions are counted over real tokens only, so a sequence sees the positions it
would see alone, whatever its neighbours. Otherwise each row decodes alone, as `generate` runs one sequence: with
the cache the model makes for itself ("per_request"), or, for a model that keeps its state inside its modules, by
a full forward over the sequence so far at each step ("recompute").
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from models.body import returned_cache, run_body
from models.forward import pad_left
from models.head import head_logits
from models.kv_buffer import BufferCache, cache_of, select_into, stack_left_padded
from models.packed import DECODE_LENGTHS
from models.plan import ForwardPlan


@dataclass
class RowState:
    """One row decoding alone: the tokens fed so far, the model's own cache after them (None when each step
    recomputes), and its last hidden state; a token fed by a step that then failed elsewhere waits as `pending`."""

    tokens: list[int]
    cache: object | None
    last_hidden: torch.Tensor  # [H]
    pending: tuple[int, object | None, torch.Tensor] | None = None  # (token, cache after it, its hidden state)


@dataclass
class DecodeBatch:
    """The sequences being decoded together: one key/value cache with a mask of its real columns, or rows alone.

    `final_widths` (batched, optional) is the most columns each row can reach (its prompt plus its new tokens): the
    cache's buffers are sized for the largest, so no step reallocates; without them a full buffer doubles.
    """

    cache: BufferCache | None  # batched: per layer keys/values [B, H_kv, T, D], views of [B, H_kv, capacity, D]
    attention_mask: torch.Tensor | None  # batched: [B, T] long, 1 = real token, left padding = 0
    rows: list[RowState] = field(default_factory=list)  # each row alone (cache is None)
    final_widths: list[int] | None = None  # batched: per row, the width it may grow to

    @property
    def capacity(self) -> int:
        """Columns to size the cache's buffers for: the largest final width (0 when unknown)."""
        return max(self.final_widths, default=0) if self.final_widths else 0

    @property
    def size(self) -> int:
        return len(self.rows) if self.cache is None else self.attention_mask.shape[0]

    @property
    def width(self) -> int:
        if self.cache is None:
            return max((len(row.tokens) for row in self.rows), default=0)
        return self.attention_mask.shape[1]


def _run(plan: ForwardPlan, input_ids, attention_mask, position_ids, cache: BufferCache, **kwargs) -> torch.Tensor:
    return run_body(plan.body, input_ids, cache=cache, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=True, **kwargs)


def _alone(plan: ForwardPlan, tokens: Sequence[int], cache: object | None, device: torch.device
           ) -> tuple[object | None, torch.Tensor]:
    """Feed `tokens` to one row through the body: over `cache` when given (extended in place), else from scratch
    keeping the model's own cache when the plan decodes per request. Returns (its cache, hidden [len, H])."""
    input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    if cache is not None:
        return cache, run_body(plan.body, input_ids, cache=cache, use_cache=True)[0]
    keep = plan.decoding == "per_request"
    output = plan.body(input_ids=input_ids, use_cache=keep)
    return (returned_cache(output) if keep else None), output.last_hidden_state[0]


@torch.inference_mode()
def prefill(model: PreTrainedModel, plan: ForwardPlan, sequences: Sequence[Sequence[int]], pad_token_id: int
            ) -> tuple[torch.Tensor, DecodeBatch]:
    """Run whole prompts into a fresh cache: last hidden states [B, T, H] (each row's real positions at its right
    end) and the batch to decode from."""
    if plan.decoding != "batched":
        rows, hidden = [], []
        for seq in sequences:
            cache, states = _alone(plan, seq, None, model.device)  # [L, H]
            if plan.decoding == "per_request" and cache is None:
                raise RuntimeError("the model returned no cache to decode from")
            rows.append(RowState(list(seq), cache, states[-1]))
            hidden.append(states)
        width = max(len(seq) for seq in sequences)
        out = hidden[0].new_zeros((len(sequences), width, hidden[0].shape[-1]))  # [B, T, H], left-padded
        for b, states in enumerate(hidden):
            out[b, width - states.shape[0]:] = states
        return out, DecodeBatch(None, None, rows)
    input_ids, attention_mask, position_ids = pad_left(sequences, pad_token_id, model.device)
    cache = BufferCache()  # full-attention layers only: rows are re-laid out on merge, which sliding layers forbid
    hidden = _run(plan, input_ids, attention_mask, position_ids, cache)  # [B, T, H]
    return hidden, DecodeBatch(cache, attention_mask)


@torch.inference_mode()
def decode_step(model: PreTrainedModel, plan: ForwardPlan, batch: DecodeBatch, next_tokens: torch.Tensor
                ) -> torch.Tensor:
    """Feed one token per row ([B] int64) and return the float32 next-token logits [B, V]; the batch grows by one
    column, written into the cache's buffers in place. Rows alone: a row that already took its token in a step that failed on another row is not fed again."""
    if batch.cache is None:
        for row, token in zip(batch.rows, next_tokens.tolist()):
            if row.pending is None or row.pending[0] != token:
                fed = row.tokens + [token] if row.cache is None else [token]
                cache, states = _alone(plan, fed, row.cache, model.device)
                row.pending = (token, cache, states[-1])
        for row in batch.rows:  # every row succeeded: commit
            token, cache, hidden = row.pending
            row.tokens.append(token)
            row.cache, row.last_hidden, row.pending = cache, hidden, None
        return head_logits(plan, torch.stack([row.last_hidden for row in batch.rows]))
    mask = torch.cat([batch.attention_mask, batch.attention_mask.new_ones((batch.size, 1))], dim=1)  # [B, T+1]
    lengths = mask.sum(dim=1)  # [B], each row's real tokens: the last columns of its keys (the cache is left-padded)
    position_ids = (lengths - 1)[:, None]  # [B, 1], the count of real tokens before this one
    # the decode kernel reads each row's keys by its length instead of the mask (models/packed.py)
    kernel = {DECODE_LENGTHS: lengths} if plan.decode_kernel else {}
    hidden = _run(plan, next_tokens.view(-1, 1).to(model.device), mask, position_ids, batch.cache, **kernel)  # [B, 1, H]
    batch.attention_mask = mask
    return head_logits(plan, hidden[:, -1, :])


def drop_partial_step(batch: DecodeBatch, width: int) -> None:
    """After a failed decode step: cut the column that the layers it reached appended, so every layer holds `width`
    columns again (the attention mask grows only when a step succeeds). Rows alone keep what they took as pending."""
    if batch.cache is None:
        return
    for layer in batch.cache.layers:
        if layer.keys is not None and layer.keys.shape[-2] > width:
            layer.keys, layer.values = layer.keys[..., :width, :], layer.values[..., :width, :]


def _layers(cache: BufferCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.inference_mode()
def select_rows(batch: DecodeBatch, rows: Sequence[int], final_widths: Sequence[int] | None = None) -> DecodeBatch:
    """Keep (or repeat, or reorder) the given rows, then drop columns that became padding in every row. `final_widths`
    (one per kept row) replaces the rows' final widths; by default each keeps its own."""
    if batch.cache is None:
        picked, seen = [], set()
        for r in rows:  # a repeated row (several choices of one prompt) decodes on a copy of its state
            picked.append(copy.deepcopy(batch.rows[r]) if r in seen else batch.rows[r])
            seen.add(r)
        return DecodeBatch(None, None, picked)
    rows = list(rows)
    if final_widths is None and batch.final_widths is not None:
        final_widths = [batch.final_widths[r] for r in rows]
    index = torch.tensor(rows, dtype=torch.long, device=batch.attention_mask.device)
    mask = batch.attention_mask.index_select(0, index)  # [b, T]
    real_columns = mask.any(dim=0).nonzero()
    start = int(real_columns[0]) if len(real_columns) else mask.shape[1]
    capacity = max(final_widths, default=0) if final_widths else 0
    # trimmed and selected straight into fresh buffers: the kept columns are written once, with room to grow
    buffers = [select_into(k, v, index.to(k.device), start, capacity) for k, v in _layers(batch.cache)]
    return DecodeBatch(cache_of(buffers, mask.shape[1] - start), mask[:, start:].contiguous(),
                       final_widths=list(final_widths) if final_widths is not None else None)


@torch.inference_mode()
def merge(first: DecodeBatch | None, second: DecodeBatch) -> DecodeBatch:
    """Rows of `first` then rows of `second`, left-padded to the wider of the two."""
    if first is None or first.size == 0:
        return second
    if second.cache is None:
        return DecodeBatch(None, None, first.rows + second.rows)
    width = max(first.width, second.width)
    final_widths = None
    if first.final_widths is not None and second.final_widths is not None:
        final_widths = first.final_widths + second.final_widths
    capacity = max(first.capacity, second.capacity)
    buffers = [stack_left_padded([pair1, pair2], width, capacity)
               for pair1, pair2 in zip(_layers(first.cache), _layers(second.cache))]
    mask = torch.cat([_pad_columns_left(first.attention_mask, width, 1),
                      _pad_columns_left(second.attention_mask, width, 1)], dim=0)  # [B1 + B2, T]
    return DecodeBatch(cache_of(buffers, width), mask, final_widths=final_widths)


def _pad_columns_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
