"""Incremental decoding primitives: prefill into a KV cache, one batched decode step, and the batch-cache surgery
(select rows, merge two batches, trim shared left padding) that lets sequences join and leave between steps.

The running batch is a transformers DynamicCache whose rows are left-padded to a common length T, plus a 2D
attention mask [B, T] (1 = real token). Positions are counted over real tokens only, so a sequence sees the
positions it would see alone, whatever its neighbours.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from models.forward import pad_left
from models.head import head_logits


@lru_cache(maxsize=8)
def _cache_kwarg(forward_type: type) -> str:
    # transformers renamed `past_key_values` to `cache` during 5.x; take whichever this version's base model has
    params = inspect.signature(forward_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class DecodeBatch:
    """The KV cache of the sequences being decoded together, and which of its columns are real tokens."""

    cache: DynamicCache  # per layer keys/values [B, H_kv, T, D]
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token, left padding = 0

    @property
    def size(self) -> int:
        return self.attention_mask.shape[0]

    @property
    def width(self) -> int:
        return self.attention_mask.shape[1]


def _run(model: PreTrainedModel, input_ids, attention_mask, position_ids, cache: DynamicCache) -> torch.Tensor:
    base = model.base_model
    kwargs = {_cache_kwarg(type(base)): cache}
    return base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                **kwargs).last_hidden_state


@torch.inference_mode()
def prefill(model: PreTrainedModel, sequences: Sequence[Sequence[int]], pad_token_id: int
            ) -> tuple[torch.Tensor, DecodeBatch]:
    """Run whole prompts (left-padded) into a fresh cache: last hidden states [B, T, H] and the batch to decode from."""
    input_ids, attention_mask, position_ids = pad_left(sequences, pad_token_id, model.device)
    cache = DynamicCache()  # full-attention layers only: rows are re-laid out on merge, which sliding layers forbid
    hidden = _run(model, input_ids, attention_mask, position_ids, cache)  # [B, T, H]
    return hidden, DecodeBatch(cache, attention_mask)


@torch.inference_mode()
def decode_step(model: PreTrainedModel, batch: DecodeBatch, next_tokens: torch.Tensor) -> torch.Tensor:
    """Feed one token per row ([B] int64) and return the float32 next-token logits [B, V]; the batch grows by one column."""
    mask = torch.cat([batch.attention_mask, batch.attention_mask.new_ones((batch.size, 1))], dim=1)  # [B, T+1]
    position_ids = mask.sum(dim=1, keepdim=True) - 1  # [B, 1], the count of real tokens before this one
    hidden = _run(model, next_tokens.view(-1, 1).to(model.device), mask, position_ids, batch.cache)  # [B, 1, H]
    batch.attention_mask = mask
    return head_logits(model, hidden[:, -1, :])


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache_from(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache holding these tensors themselves: DynamicCache(ddp_cache_data=...) would copy every layer once more
    (its update concatenates onto an empty tensor), so merge and select_rows would peak at three caches, not two."""
    cache = DynamicCache()
    built = []
    for keys, values in layers:
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys.contiguous(), values.contiguous()  # [B, H_kv, T, D]
        built.append(layer)
    cache.layers = built
    return cache


@torch.inference_mode()
def select_rows(batch: DecodeBatch, rows: Sequence[int]) -> DecodeBatch:
    """Keep (or repeat, or reorder) the given rows, then drop columns that became padding in every row."""
    index = torch.tensor(list(rows), dtype=torch.long, device=batch.attention_mask.device)
    mask = batch.attention_mask.index_select(0, index)  # [b, T]
    real_columns = mask.any(dim=0).nonzero()
    start = int(real_columns[0]) if len(real_columns) else mask.shape[1]
    # trim before selecting: index_select then writes the kept columns only, into fresh contiguous tensors
    layers = [(k[:, :, start:].index_select(0, index.to(k.device)), v[:, :, start:].index_select(0, index.to(v.device)))
              for k, v in _layers(batch.cache)]
    return DecodeBatch(_cache_from(layers), mask[:, start:].contiguous())


def _pad_columns_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@torch.inference_mode()
def merge(first: DecodeBatch | None, second: DecodeBatch) -> DecodeBatch:
    """Rows of `first` then rows of `second`, left-padded to the wider of the two."""
    if first is None or first.size == 0:
        return second
    width = max(first.width, second.width)
    layers = []
    for (k1, v1), (k2, v2) in zip(_layers(first.cache), _layers(second.cache)):
        layers.append((torch.cat([_pad_columns_left(k1, width, 2), _pad_columns_left(k2, width, 2)], dim=0),
                       torch.cat([_pad_columns_left(v1, width, 2), _pad_columns_left(v2, width, 2)], dim=0)))
    mask = torch.cat([_pad_columns_left(first.attention_mask, width, 1),
                      _pad_columns_left(second.attention_mask, width, 1)], dim=0)  # [B1 + B2, T]
    return DecodeBatch(_cache_from(layers), mask)
