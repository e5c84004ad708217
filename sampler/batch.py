"""Batch-level checks and row selection shared by the sampler modules."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .params import SamplingParams


def check_batch(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Raise ValueError unless logits is [B, V] floating point with one SamplingParams per row
    and every token id named by params is inside the vocabulary."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    batch, vocab = logits.shape
    if len(params) != batch:
        raise ValueError(f"got {len(params)} SamplingParams for {batch} logits rows")
    if vocab == 0:
        raise ValueError("logits have an empty vocabulary")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"row {i}: expected SamplingParams, got {type(p).__name__}")
        ids = list(p.label_token_ids) + [tok for tok, _ in p.logit_bias]
        if ids and max(ids) >= vocab:
            raise ValueError(f"row {i}: token id {max(ids)} outside vocabulary of size {vocab}")


def row_index(
    params: Sequence[SamplingParams], pred: Callable[[SamplingParams], bool], device: torch.device
) -> tuple[list[int], torch.Tensor | None]:
    """Rows whose params satisfy pred, as a list and as an int64 index tensor ([n]).

    The tensor is None when every row matches, so callers can work on the whole
    batch in place instead of gathering a copy of all rows.
    """
    rows = [i for i, p in enumerate(params) if pred(p)]
    if len(rows) == len(params):
        return rows, None
    return rows, torch.tensor(rows, dtype=torch.long, device=device)


def column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row scalars as a float32 [n, 1] column on like's device, ready to broadcast over V."""
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)
