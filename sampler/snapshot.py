"""snapshot(): the one [B, V] tensor each row's logprobs, candidates and top list are all read from."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batch import check_batch, row_index
from .params import SamplingParams
from .processors import apply_processors_

# stands in for rows whose mode is raw: they must see no processor at all
_NO_PROCESSING = SamplingParams()


def snapshot(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[B, V] float32, row r under params[r].logprobs_mode; logits itself is never written."""
    check_batch(logits, params)
    x = logits.float()  # [B, V]; the same tensor as logits when already float32 -> read only

    # processors run only on rows of a processed mode that actually enable one
    effective = [p if p.logprobs_mode.is_processed else _NO_PROCESSING for p in params]
    if any(p.needs_processing for p in effective):
        if x is logits:
            x = x.clone()  # [B, V] private copy before writing
        apply_processors_(x, effective)

    rows, idx = row_index(params, lambda p: p.logprobs_mode.is_logprobs, x.device)
    if idx is None:
        # the common case (all rows want logprobs): one log_softmax, already a new tensor
        return torch.log_softmax(x, dim=-1)
    if x is logits:
        x = x.clone()  # logits modes return a copy, never the caller's tensor
    if rows:
        x[idx] = torch.log_softmax(x[idx], dim=-1)  # [n, V]
    return x
