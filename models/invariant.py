"""Batch invariance: every linear layer computed in fixed row tiles, so a row's numbers never depend on how many
rows share its call; which models run that way, and the load-time proof that a batch does not move a row."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from models.prepack import PrepackedLinear

# GEMM kernels pick their blocking, and so the order in which they sum over the inner dimension, from the row
# count M (measured with oneDNN on an AMX CPU: bfloat16 576->1536 sums one way for 16-32 rows and 768-1024, another
# for 33-640; float32 nn.Linear changes below 16 rows). A call whose shape is one of a few fixed sizes that sum the
# same way gives a row the same numbers wherever it sits: rows run in tiles of those sizes, the last tile padded
# with zero rows. The sizes each layer may use are found at load (_agreeing_sizes): the largest set of TILE_SIZES
# whose calls give the same bits.
TILE_SIZES = (1024, 512, 256, 128, 64, 32)  # 1024: one packed row (models/forward.py PACK_TOKENS)
# The output head: few rows per batch, and [1024, V] logits over a large vocabulary would be a large buffer.
HEAD_TILE_SIZES = (256, 128, 64, 32)
# A tile may be padded to at most this share of zero rows before smaller tiles are used instead; fewer, larger
# calls are faster per row (docs/users/batch-invariance.md).
MAX_PADDING = 0.5

def tile_plan(rows: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, tile size) of each tile covering `rows` rows, from `sizes` (descending, all summing the same way)."""
    plan, start = [], 0
    while start < rows:
        left = rows - start
        fitting = [s for s in sizes if s <= left]
        size = fitting[0] if fitting else sizes[-1]
        bigger = [s for s in sizes if s > left]
        if bigger and (bigger[-1] - left) <= MAX_PADDING * bigger[-1]:
            size = bigger[-1]  # one padded tile instead of several smaller calls
        plan.append((start, size))
        start += size
    return plan


class RowTiledLinear(nn.Module):
    """Runs the wrapped linear layer on fixed-size row tiles (the last one zero-padded), so each output row is the
    same function of its input row whatever the number of rows in the call; the math is the wrapped layer's."""

    def __init__(self, inner: nn.Module, sizes: tuple[int, ...]):
        super().__init__()
        self.inner = inner
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        if rows.shape[0] == 0:
            return self.inner(x)
        outs = []
        for start, size in tile_plan(rows.shape[0], self.sizes):
            tile = rows[start : start + size]  # [<= size, in]
            real = tile.shape[0]
            if real < size:  # zero rows only produce their own (discarded) outputs
                tile = torch.cat([tile, tile.new_zeros(size - real, tile.shape[1])])
            outs.append(self.inner(tile)[:real])  # [real, out]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # one tile: no copy of the output
        return out.reshape(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"tiles={self.sizes}"


# The layers that compute each output row from its input row alone (a GEMM); anything else is left as it is.
_ROW_WISE = (nn.Linear, PrepackedLinear, Conv1D)


def _in_features(layer: nn.Module) -> int:
    if isinstance(layer, Conv1D):
        return layer.weight.shape[0]
    return layer.in_features


@torch.inference_mode()
def _agreeing_sizes(layer: nn.Module, sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """The largest subset of `sizes` (descending) whose calls give every row the same bits from `layer`."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(sizes[0], _in_features(layer), generator=generator).to(device=device, dtype=dtype)
    classes: list[tuple[torch.Tensor, list[int]]] = []  # (rows computed in calls of size s, [s, ...])
    for size in sizes:
        out = torch.cat([layer(x[s : s + size]) for s in range(0, sizes[0], size)])  # [sizes[0], out]
        for rows, members in classes:
            if torch.equal(rows, out):
                members.append(size)
                break
        else:
            classes.append((out, [size]))
    # most sizes first; among equals, the one with the smallest tile (least padding for small calls)
    best = max(classes, key=lambda c: (len(c[1]), -c[1][-1]))[1]
    return tuple(best)


def _wrap_row_wise(root: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Wrap every row-wise layer under `root` in a RowTiledLinear; returns how many were wrapped."""
    verdicts: dict[tuple, tuple[int, ...]] = {}  # one check per kind and shape of layer
    wrapped = 0
    for module in list(root.modules()):
        for name, child in list(module.named_children()):
            if type(child) not in _ROW_WISE:
                continue
            weight = child.packed_weight if isinstance(child, PrepackedLinear) else child.weight
            shape = (type(child), _in_features(child), *weight.shape, weight.dtype)
            if shape not in verdicts:
                verdicts[shape] = _agreeing_sizes(child, TILE_SIZES, dtype, device)
            setattr(module, name, RowTiledLinear(child, verdicts[shape]))
            wrapped += 1
    return wrapped


def make_batch_invariant(model: PreTrainedModel, body: nn.Module) -> nn.Module:
    """Run every row-wise layer of the decoder body in fixed row tiles; returns lm_head run in its own fixed tiles.

    The model's lm_head is left alone: the returned module runs in the head's view (models/head.py build_head),
    with tile sizes found here, once. A plan marked batch_invariant then lays out each sequence in a shape that
    does not depend on its neighbours (models/forward.py, models/prefix.py).
    """
    _wrap_row_wise(body, model.dtype, model.device)
    head = model.get_output_embeddings()
    sizes = (HEAD_TILE_SIZES[-1],)
    if type(head) in _ROW_WISE:
        sizes = _agreeing_sizes(head, HEAD_TILE_SIZES, model.dtype, model.device)
    return RowTiledLinear(head, sizes)
