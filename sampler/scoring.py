"""score(): label values, label ranks and the top list, all read from one snapshot; to_rows() is the .tolist() edge."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .batch import check_batch
from .params import SamplingParams
from .snapshot import snapshot

# up to this many labels per row, ranks come from one [B, V] comparison per label;
# beyond it one ascending sort + searchsorted is cheaper (a full sort costs ~50 comparisons' worth on CPU)
_RANK_BY_COMPARE_MAX_LABELS = 48


class ScoreOutput(NamedTuple):
    """Batch tensors, padded across rows to L = max label count and K = max top_logprobs (capped at V)."""

    label_values: torch.Tensor  # [B, L] float32, snapshot values of label_token_ids (padding arbitrary)
    label_ranks: torch.Tensor  # [B, L] int64, 1 + number of tokens with a strictly greater snapshot value
    top_ids: torch.Tensor  # [B, K] int64, by value desc, ties by lower id first
    top_values: torch.Tensor  # [B, K] float32, the same snapshot values


class RowScores(NamedTuple):
    """One row of a ScoreOutput, cut to that row's own label count and top_logprobs."""

    label_values: list[float]
    label_ranks: list[int]
    top_ids: list[int]
    top_values: list[float]


def score(logits: torch.Tensor, params: Sequence[SamplingParams]) -> ScoreOutput:
    """Gather label values / ranks and the top list of logits [B, V] under each row's mode."""
    check_batch(logits, params)
    batch, vocab = logits.shape
    dev = logits.device
    n_labels = max((len(p.label_token_ids) for p in params), default=0)  # L
    n_top = min(max((p.top_logprobs for p in params), default=0), vocab)  # K

    if n_labels == 0 and n_top == 0:
        # nothing asked: no snapshot at all
        return ScoreOutput(
            label_values=torch.empty((batch, 0), dtype=torch.float32, device=dev),
            label_ranks=torch.empty((batch, 0), dtype=torch.long, device=dev),
            top_ids=torch.empty((batch, 0), dtype=torch.long, device=dev),
            top_values=torch.empty((batch, 0), dtype=torch.float32, device=dev),
        )

    snap = snapshot(logits, params)  # [B, V] float32, the single source for everything below
    # the sum is NaN whenever any entry is (one cheap reduction); only then pay for the exact test
    if torch.isnan(snap.sum()) and torch.isnan(snap).any():
        # NaN has no rank and no order; it comes from NaN/+inf logits or a temperature so small it overflows
        raise ValueError("snapshot contains NaN (non-finite logits or an overflowing temperature)")

    label_ids = torch.tensor(
        [list(p.label_token_ids) + [0] * (n_labels - len(p.label_token_ids)) for p in params],
        dtype=torch.long,
        device=dev,
    ).view(batch, n_labels)  # [B, L], padded with token 0
    label_values = snap.gather(1, label_ids)  # [B, L]
    label_ranks = _ranks(snap, label_values)  # [B, L]
    top_ids, top_values = _top_list(snap, n_top)  # [B, K], [B, K]
    return ScoreOutput(label_values, label_ranks, top_ids, top_values)


def to_rows(out: ScoreOutput, params: Sequence[SamplingParams]) -> list[RowScores]:
    """The edge: one .tolist() per tensor, then each row sliced to its own L and K."""
    values = out.label_values.tolist()
    ranks = out.label_ranks.tolist()
    ids = out.top_ids.tolist()
    top_values = out.top_values.tolist()
    rows = []
    for r, p in enumerate(params):
        n, k = len(p.label_token_ids), p.top_logprobs  # K was capped at V, slicing caps k too
        rows.append(RowScores(values[r][:n], ranks[r][:n], ids[r][:k], top_values[r][:k]))
    return rows


def _ranks(snap: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """1 + count of snapshot entries strictly greater than each value: [B, V], [B, L] -> [B, L] int64."""
    n_labels = values.shape[1]
    if n_labels == 0:
        return torch.empty(values.shape, dtype=torch.long, device=values.device)
    if n_labels <= _RANK_BY_COMPARE_MAX_LABELS:
        # one label at a time keeps the temporary at [B, V] bools instead of [B, L, V]
        greater = [(snap > values[:, j : j + 1]).sum(dim=-1, dtype=torch.int32) for j in range(n_labels)]  # L x [B]
        return torch.stack(greater, dim=1).long() + 1
    ascending = torch.sort(snap, dim=-1).values  # [B, V]
    # right=True: index of the first entry > value, i.e. how many are <= value
    not_greater = torch.searchsorted(ascending, values.contiguous(), right=True)  # [B, L]
    return snap.shape[1] - not_greater + 1


def _top_list(snap: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and values of each row, by value desc, ties by lower id first: [B, V] -> [B, K] x2.

    torch.topk chooses arbitrarily among tokens tied at the k-th value and orders
    ties arbitrarily; both are made deterministic here without a full-vocab sort.
    """
    batch, vocab = snap.shape
    if k == 0:
        return (
            torch.empty((batch, 0), dtype=torch.long, device=snap.device),
            torch.empty((batch, 0), dtype=torch.float32, device=snap.device),
        )
    # one extra value tells whether a tie straddles the k-th place in any row
    extra = min(k + 1, vocab)
    values, ids = torch.topk(snap, extra, dim=-1)  # [B, k+1]
    kth = values[:, k - 1 : k]  # [B, 1], the k-th largest value
    if extra > k and bool((values[:, k : k + 1] == kth).any()):
        # some row has more tokens tied at the k-th value than places left: take every token
        # above it, then the lowest-id tokens tied with it, in one vectorised pass
        above = snap > kth  # [B, V], fewer than k per row
        tied = snap == kth  # [B, V]
        need = k - above.sum(dim=-1, keepdim=True)  # [B, 1], >= 1
        chosen = above | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= need))  # [B, V], k per row
        ids = chosen.nonzero()[:, 1].view(batch, k)  # [B, K], row-major -> ascending id per row
    else:
        # the topk set is already the exact set; only its order among ties is arbitrary
        ids = ids[:, :k].sort(dim=-1).values  # [B, K], ascending id
    values = snap.gather(1, ids)  # [B, K]
    # stable sort of id-ascending input: equal values stay lower id first
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)  # [B, K]
    return ids.gather(1, order), values
