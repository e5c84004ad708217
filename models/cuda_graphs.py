"""CUDA graphs of the packed scoring forward: the body captured once per bucket of packed lengths at load, and
replayed with each call's inputs copied into that bucket's static buffers, so a forward is a few launches from the
host instead of hundreds."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.packed import PACKED_ROW, PackedRow, no_padding

GRAPHS_PATH = "cuda_graphs"  # its name among the fast paths (models/selfcheck.py)
# Devices the self-check captures graphs on.
DEVICE_TYPES = ("cuda",)
# Packed lengths graphs are captured for: a call pads up to the smallest bucket that holds it. Half-precision calls
# pack up to 2048 tokens (models/forward.py pack_tokens); a longer call runs eagerly.
BUCKET_TOKENS = (128, 256, 512, 1024, 2048)
# Segments a bucket holds, per token: a call of more (shorter) prompts than tokens // 8, plus one segment of padding,
# runs eagerly.
TOKENS_PER_SEGMENT = 8


def stand_in_graph():
    """What replays a captured forward off CUDA: nothing does in serving (DEVICE_TYPES); tests put a stand-in here
    that runs the captured call again into its output buffer."""
    raise RuntimeError("CUDA graphs run on CUDA only")


def padded_lengths(lengths: Sequence[int], tokens: int, segments: int) -> list[int] | None:
    """The segment lengths of `lengths` padded to exactly `tokens` tokens in exactly `segments` segments, every
    padding segment at least one token long (so the kernel sees no empty segment); None when they do not fit."""
    pad_tokens, pad_segments = tokens - sum(lengths), segments - len(lengths)
    if pad_segments < 1 or pad_tokens < pad_segments or 0 in lengths:
        return None
    return [*lengths, *([1] * (pad_segments - 1)), pad_tokens - (pad_segments - 1)]


@dataclass
class _Bucket:
    """One captured forward: its static inputs and output, and the graph that replays it."""

    tokens: int
    segments: int
    input_ids: torch.Tensor  # [1, tokens]
    position_ids: torch.Tensor  # [1, tokens]
    ones: torch.Tensor  # [1, tokens], the padding mask of a packed row: no padding
    cu_seqlens: torch.Tensor  # [segments + 1] int32
    hidden: torch.Tensor | None = None  # [1, tokens, H], written by every replay
    graph: object | None = None


def _host_layout(sequences: Sequence[Sequence[int]], lengths: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Token ids, position ids and boundaries of `sequences` followed by padding segments of `lengths[len(sequences):]`
    (token 0 at position 0: padding rows are never read, and attention stays inside each segment)."""
    ids = [token for seq in sequences for token in seq]
    positions = [i for seq in sequences for i in range(len(seq))]
    pad = sum(lengths) - len(ids)
    bounds, end = [0], 0
    for length in lengths:
        end += length
        bounds.append(end)
    return ids + [0] * pad, positions + [0] * pad, bounds


class PackedGraphs:
    """The packed body forward captured per bucket (tokens, segments) through one attention kernel.

    Every bucket reads its segment boundaries from a device buffer, so the kernel must take them from there: the
    varlen kernel does (models/attention_cuda.py); the per-segment loop reads boundaries fixed at capture and is
    never graphed. Buckets share one memory pool, captured largest first.
    """

    def __init__(self, body: nn.Module, kernel: str, device: torch.device,
                 bucket_tokens: Sequence[int] | None = None):
        self.body, self.kernel, self.device = body, kernel, device
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.buckets: list[_Bucket] = []
        for tokens in sorted(bucket_tokens or BUCKET_TOKENS, reverse=True):
            self.buckets.append(self._capture(tokens, max(8, tokens // TOKENS_PER_SEGMENT)))
        self.buckets.reverse()  # smallest first, for bucket_for

    @property
    def bucket_tokens(self) -> list[int]:
        return [bucket.tokens for bucket in self.buckets]

    def _row(self, bucket: _Bucket, bounds: Sequence[int]) -> PackedRow:
        # max_length bounds every segment; the kernel reads the real boundaries from cu_seqlens on the device
        return PackedRow(tuple(bounds), bucket.cu_seqlens, bucket.tokens, kernel=self.kernel)

    def _run(self, bucket: _Bucket, row: PackedRow) -> torch.Tensor:
        with no_padding():
            return self.body(input_ids=bucket.input_ids, attention_mask=bucket.ones, position_ids=bucket.position_ids,
                             use_cache=False, **{PACKED_ROW: row}).last_hidden_state  # [1, tokens, H]

    def _capture(self, tokens: int, segments: int) -> _Bucket:
        lengths = padded_lengths([], tokens, segments)
        ids, positions, bounds = _host_layout([], lengths)
        device = self.device
        bucket = _Bucket(tokens, segments, torch.tensor([ids], device=device), torch.tensor([positions], device=device),
                         torch.ones((1, tokens), dtype=torch.long, device=device),
                         torch.tensor(bounds, dtype=torch.int32, device=device))
        row = self._row(bucket, bounds)
        if self._pool is None:  # a stand-in for a graph off CUDA (tests): it records the call and replays it
            bucket.graph = stand_in_graph()
            bucket.hidden = bucket.graph.capture(lambda: self._run(bucket, row))
            return bucket
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up off the capture, as torch.cuda.graph asks
            for _ in range(2):
                self._run(bucket, row)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.hidden = self._run(bucket, row)
        bucket.graph = graph
        return bucket

    def only(self, tokens: int) -> PackedGraphs:
        """The same graphs restricted to the bucket of `tokens` tokens (the self-check proves each bucket alone)."""
        view = copy.copy(self)
        view.buckets = [bucket for bucket in self.buckets if bucket.tokens == tokens]
        return view

    def bucket_for(self, lengths: Sequence[int]) -> tuple[_Bucket, list[int]] | None:
        """The smallest bucket that holds segments of `lengths`, with their padded lengths; None when none does."""
        for bucket in self.buckets:
            padded = padded_lengths(lengths, bucket.tokens, bucket.segments)
            if padded is not None:
                return bucket, padded
        return None

    def hidden(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """The final hidden states of `sequences` packed back to back, [T, H], by replaying a bucket's graph; None
        when no bucket holds them (the caller runs the forward eagerly)."""
        found = self.bucket_for([len(seq) for seq in sequences])
        if found is None:
            return None
        bucket, lengths = found
        ids, positions, bounds = _host_layout(sequences, lengths)
        for static, values, dtype in ((bucket.input_ids, [ids], torch.long), (bucket.position_ids, [positions], torch.long),
                                      (bucket.cu_seqlens, bounds, torch.int32)):
            host = torch.tensor(values, dtype=dtype)
            static.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)
        bucket.graph.replay()
        # the output buffer is overwritten by the next replay: callers gather their rows before it, on the same stream
        return bucket.hidden[0, : sum(len(seq) for seq in sequences)]
