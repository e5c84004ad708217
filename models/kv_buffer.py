"""The decode batch's key/value cache written in place: per layer, key and value buffers with spare columns, so a
decode step writes one column instead of concatenating (copying) the whole cache, through transformers' own cache
API (a DynamicCache whose layers' `update` writes into the buffer and returns views); attention is untouched."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class BufferLayer(DynamicLayer):
    """One layer's keys and values: `keys`/`values` are views [B, H_kv, T, D] of buffers [B, H_kv, capacity, D].

    T is always `keys.shape[-2]`, so whatever narrows the view (crop, a failed step's column cut) also moves the
    point the next update writes at. Columns past T are never read: they may hold anything.
    """

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity  # columns to allocate for when the first update comes (more if it needs more)
        self.key_buffer: torch.Tensor | None = None  # [B, H_kv, capacity, D]
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def adopt(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        """Hold these buffers, the first `length` columns being the cache."""
        self.lazy_initialization(key_buffer, value_buffer)
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        self.capacity = key_buffer.shape[-2]
        self.keys, self.values = key_buffer[:, :, :length], value_buffer[:, :, :length]

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key_states/value_states [B, H_kv, t, D] after the cached columns; return views of all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if self.key_buffer is None or end > self.key_buffer.shape[-2]:
            self._grow(key_states, value_states, start, end)
        self.key_buffer[:, :, start:end].copy_(key_states)
        self.value_buffer[:, :, start:end].copy_(value_states)
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int, end: int) -> None:
        """New buffers for at least `end` columns: the capacity asked for; past it, a quarter more each time (amortised
        O(1) copies a column, while the spare columns stay within the byte model's allowance for a growing cache)."""
        old = self.key_buffer.shape[-2] if self.key_buffer is not None else 0
        capacity = max(end, self.capacity, old + max(old // 4, 16) if old else 0)
        batch, heads, _, head_dim = key_states.shape
        keys = key_states.new_empty((batch, heads, capacity, head_dim))
        values = value_states.new_empty((batch, value_states.shape[1], capacity, value_states.shape[-1]))
        if start:
            keys[:, :, :start].copy_(self.keys)
            values[:, :, :start].copy_(self.values)
        self.key_buffer, self.value_buffer, self.capacity = keys, values, capacity

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # narrows the views: the buffer keeps its columns

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self._replace_rows(torch.arange(self.keys.shape[0], device=self.keys.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._replace_rows(torch.arange(self.keys.shape[0], device=self.keys.device)[indices])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self._replace_rows(beam_idx)

    def _replace_rows(self, rows: torch.Tensor) -> None:
        keys, values = self.keys, self.values
        self.adopt(*select_into(keys, values, rows.to(keys.device), 0, self.capacity), keys.shape[-2])

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        super().reset()


class BufferCache(DynamicCache):
    """A DynamicCache of BufferLayers, each allocating `capacity` columns when it is first written (0: just what the
    first update needs, growing by a quarter after)."""

    def __init__(self, capacity: int = 0, layers: list[BufferLayer] | None = None):
        # Cache's own constructor: DynamicCache's would lay out DynamicLayers (or ones for a config's layer types)
        if layers is None:
            Cache.__init__(self, layer_class_to_replicate=BufferLayer)
        else:
            Cache.__init__(self, layers=list(layers))
        self.capacity = capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        while self.layer_class_to_replicate is not None and len(self.layers) <= layer_idx:
            self.layers.append(BufferLayer(self.capacity))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def layer_capacity(self) -> int:
        """The columns each layer's buffers hold (the cache's capacity before the first update)."""
        held = [layer.key_buffer.shape[-2] for layer in self.layers if layer.key_buffer is not None]
        return max(held, default=self.capacity)


def select_into(keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, start: int, capacity: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh buffers [len(rows), H_kv, max(capacity, T - start), D] holding rows `rows` of keys/values [B, H_kv, T, D]
    from column `start` on, written straight into the buffers (no intermediate copy)."""
    width = keys.shape[-2] - start
    capacity = max(capacity, width)
    out = []
    for t in (keys, values):
        buffer = t.new_empty((len(rows), t.shape[1], capacity, t.shape[-1]))
        torch.index_select(t[:, :, start:], 0, rows, out=buffer[:, :, :width])
        out.append(buffer)
    return out[0], out[1]


def stack_left_padded(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], width: int, capacity: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh buffers holding the rows of every (keys, values) [B_i, H_kv, T_i, D] one after the other, each
    right-aligned at column `width` with zeros to its left (masked out, but never garbage that could be NaN)."""
    capacity = max(capacity, width)
    keys0, values0 = parts[0]
    rows = sum(k.shape[0] for k, _ in parts)
    out = []
    for which, like in ((0, keys0), (1, values0)):
        buffer = like.new_empty((rows, like.shape[1], capacity, like.shape[-1]))
        row = 0
        for part in parts:
            t = part[which]
            b, pad = t.shape[0], width - t.shape[-2]
            buffer[row:row + b, :, :pad].zero_()
            buffer[row:row + b, :, pad:width].copy_(t)
            row += b
        out.append(buffer)
    return out[0], out[1]


def cache_of(buffers: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int) -> BufferCache:
    """A BufferCache holding these (key buffer, value buffer) pairs themselves, `length` columns of each in use."""
    layers = []
    for keys, values in buffers:
        layer = BufferLayer()
        layer.adopt(keys, values, length)
        layers.append(layer)
    cache = BufferCache(capacity=buffers[0][0].shape[-2] if buffers else 0, layers=layers)
    return cache
