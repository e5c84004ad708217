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


def test_the_default_plan_is_the_plain_path_and_reports_every_decision():
    import dataclasses

    import pytest
    from torch import nn

    from models.plan import ForwardPlan, PathCheck

    plan = ForwardPlan(body=nn.Identity(), head=nn.Identity())
    assert (plan.layout, plan.prefix_reuse, plan.decoding) == ("one_at_a_time", "off", "recompute")
    assert not plan.shares_prefixes and not plan.packed_suffixes and not plan.batch_invariant and not plan.compiled
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layout = "packed"
    built = dataclasses.replace(plan, layout="padded", prefix_reuse="whole_cache", stateful_layers=("LinearAttentionLayer",),
                                checks=(PathCheck("packed_batches", False, None, "layers carry state across positions"),))
    report = built.as_dict()
    assert (report["layout"], report["prefix_reuse"], report["decoding"]) == ("padded", "whole_cache", "recompute")
    assert report["stateful_layers"] == ["LinearAttentionLayer"] and built.shares_prefixes
    assert report["paths"] == [{"name": "packed_batches", "enabled": False, "difference": None,
                                "reason": "layers carry state across positions"}]


def test_no_module_of_models_keeps_a_registry_of_models():
    """Which path is on lives in the plan a loaded model holds, never in a module-level set or map of models."""
    import ast
    from pathlib import Path

    registries = []
    for source in sorted(Path(__file__).resolve().parents[2].joinpath("models").glob("*.py")):
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and "Weak" in ast.unparse(node.value or ast.Constant(0)):
                registries.append(f"{source.name}: {ast.unparse(node)}")
    assert registries == []
