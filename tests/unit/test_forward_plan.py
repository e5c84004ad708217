"""plan_micro_batches: the length grouping behind forward_logits (pure arithmetic, no model)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from models.forward import plan_micro_batches


def _cost(groups, lengths, overhead):
    return sum(len(g) * max(lengths[i] for i in g) + overhead for g in groups)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=12), st.integers(0, 400))
def test_plan_covers_every_sequence_once_and_is_optimal(lengths, overhead):
    groups = plan_micro_batches(lengths, overhead)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(groups)
    # Exhaustive check over every contiguous split of the length-sorted order.
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = min(
        _cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], lengths, overhead)
        for k in range(len(order))
        for cuts in itertools.combinations(range(1, len(order)), k)
    )
    assert _cost(groups, lengths, overhead) == best


def test_equal_lengths_stay_one_call_and_mixed_lengths_split():
    assert plan_micro_batches([50] * 16, 96) == [list(range(16))]
    groups = plan_micro_batches([20] * 16 + [200] * 16, 96)
    assert [sorted(g) for g in groups] == [list(range(16)), list(range(16, 32))]
