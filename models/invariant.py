"""Batch invariance: every linear layer computed in fixed row tiles, so a row's numbers never depend on how many
rows share its call; which models run that way, and the load-time proof that a batch does not move a row."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from models.prepack import PrepackedLinear

# GEMM kernels pick their blocking, and so the order in which they sum over the inner dimension, from the row
# count M (measured with oneDNN on an AMX CPU: bfloat16 576->1536 sums one way for 16-32 rows and 768-1024, another
# for 33-640; float32 nn.Linear changes below 16 rows). A call whose shape is always the same gives a row the same
# numbers wherever it sits: rows run in tiles of SMALL_TILE_ROWS, the last one padded with zero rows.
SMALL_TILE_ROWS = 32
# Large calls run in tiles of LARGE_TILE_ROWS (one packed row, models/forward.py PACK_TOKENS) where a GEMM is ~3x
# faster per row than at 32 rows; used only for a layer whose kernel gives both tile sizes the same numbers,
# which is checked per layer at load (_tiles_agree). A remainder of more than LARGE_TILE_FILL rows is padded to
# one more large tile instead of many small ones.
LARGE_TILE_ROWS = 1024
LARGE_TILE_FILL = 384

# Models whose forward passes run batch-invariant (make_batch_invariant): fixed-row linears, and callers in
# models/ lay out each sequence in a shape that does not depend on its neighbours.
_INVARIANT: weakref.WeakSet = weakref.WeakSet()


def is_batch_invariant(model: PreTrainedModel) -> bool:
    """Whether `model` was made batch-invariant (make_batch_invariant)."""
    return model in _INVARIANT


def tile_plan(rows: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, tile size) of each tile covering `rows` rows; sizes is (small,) or (large, small)."""
    plan, start = [], 0
    if len(sizes) == 2:
        large = sizes[0]
        while rows - start >= large or rows - start > LARGE_TILE_FILL:
            plan.append((start, large))
            start += large
    small = sizes[-1]
    while start < rows:
        plan.append((start, small))
        start += small
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
        return torch.cat(outs).reshape(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"tiles={self.sizes}"


# The layers that compute each output row from its input row alone (a GEMM); anything else is left as it is.
_ROW_WISE = (nn.Linear, PrepackedLinear, Conv1D)


def _in_features(layer: nn.Module) -> int:
    if isinstance(layer, Conv1D):
        return layer.weight.shape[0]
    return layer.in_features


@torch.inference_mode()
def _tiles_agree(layer: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `layer` gives rows the same bits in a LARGE_TILE_ROWS call as in SMALL_TILE_ROWS calls."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(LARGE_TILE_ROWS, _in_features(layer), generator=generator).to(device=device, dtype=dtype)
    whole = layer(x)  # [LARGE, out]
    return all(torch.equal(whole[s : s + SMALL_TILE_ROWS], layer(x[s : s + SMALL_TILE_ROWS]))
               for s in range(0, LARGE_TILE_ROWS, SMALL_TILE_ROWS))


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
                agree = _tiles_agree(child, dtype, device)
                verdicts[shape] = (LARGE_TILE_ROWS, SMALL_TILE_ROWS) if agree else (SMALL_TILE_ROWS,)
            setattr(module, name, RowTiledLinear(child, verdicts[shape]))
            wrapped += 1
    return wrapped


def make_batch_invariant(model: PreTrainedModel) -> None:
    """Run every row-wise layer of the decoder body in fixed row tiles and mark `model` batch-invariant.

    The output head is tiled in the head's own view (models/head.py), so the model's lm_head is left alone.
    """
    _wrap_row_wise(model.base_model, model.dtype, model.device)
    _INVARIANT.add(model)


def tiled_head(lm_head: nn.Module) -> nn.Module:
    """lm_head run on SMALL_TILE_ROWS-row tiles: a batch keeps few positions, and a head over a large vocabulary
    at LARGE_TILE_ROWS rows would hold [1024, V] logits at once."""
    return RowTiledLinear(lm_head, (SMALL_TILE_ROWS,))
