"""Batch invariance on every architecture of the zoo, float32 and bfloat16: a sequence's logits, and the labels, ranks
and top-N the sampler reads from them, are bit-identical (==) alone and in any batch; the same over shared prefixes,
and for prefix states prefilled alone (a cache hit from an earlier batch) or with other prefixes (a miss)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models.prefix
import models.selfcheck
import sampler
from models import forward_logits, load_model
from models.head import head_logits
from models.prefix import SuffixRow, forward_suffixes, prefill_prefixes
from models.tiny import ATTENTION_ZOO, make_tiny_model
from sampler import LogprobsMode, SamplingParams

MAX_POSITIONS = 256
VOCAB = 200  # below every tiny model's vocabulary
EXAMPLES = settings(max_examples=6, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

TARGET = [(7 * i + 3) % VOCAB for i in range(37)]  # the request under test: 37 tokens, the last 3 kept
TARGET_KEEP = 3
TARGET_PARAMS = SamplingParams(label_token_ids=(5, 17, 120), top_logprobs=5)

sequence = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=90)
mode = st.sampled_from(list(LogprobsMode))
# other requests: their tokens, how many positions each keeps, and its logprobs mode and processors
neighbour = st.tuples(sequence, st.integers(1, 3), mode, st.sampled_from([None, 0.7, 1.5]), st.sampled_from([None, 5]))


@pytest.fixture(scope="module", params=[(a, d) for a in ATTENTION_ZOO for d in ("float32", "bfloat16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def invariant(request, tmp_path_factory):
    arch, dtype = request.param
    folder = make_tiny_model(tmp_path_factory.mktemp("invariant") / arch, arch, max_positions=MAX_POSITIONS)
    return load_model(str(folder), device="cpu", dtype=dtype, cache_dir=None, batch_invariant=True)


def _sampled(logits: torch.Tensor, params: list[SamplingParams], row: int) -> sampler.RowScores:
    return sampler.to_rows(sampler.score(logits, params), params)[row]


def test_the_self_check_proves_invariance(invariant):
    assert invariant.plan.batch_invariant, invariant.plan.checks


@EXAMPLES
@given(before=st.lists(neighbour, max_size=4), after=st.lists(neighbour, max_size=4))
def test_a_sequence_gives_the_same_bits_in_any_batch(invariant, before, after):
    model, pad, plan = invariant.model, invariant.pad_token_id, invariant.plan
    alone = forward_logits(model, plan, [TARGET], pad, [TARGET_KEEP])  # [3, V]
    sequences = [n[0] for n in before] + [TARGET] + [n[0] for n in after]
    keep = [n[1] for n in before] + [TARGET_KEEP] + [n[1] for n in after]
    at = sum(keep[: len(before)])
    batched = forward_logits(model, plan, sequences, pad, keep)[at : at + TARGET_KEEP]
    assert torch.equal(batched, alone)

    # the sampler over the last positions of the whole batch, every row under its own mode and processors
    params = [SamplingParams(logprobs_mode=m, temperature=t, top_k=k, label_token_ids=(1, 2), top_logprobs=3)
              for _, _, m, t, k in before] + [TARGET_PARAMS] + [
              SamplingParams(logprobs_mode=m, temperature=t, top_k=k, label_token_ids=(3,), top_logprobs=2)
              for _, _, m, t, k in after]
    ends = torch.tensor(keep).cumsum(0) - 1
    last = forward_logits(model, plan, sequences, pad, keep)[ends]  # [B, V]
    assert _sampled(last, params, len(before)) == _sampled(alone[-1:], [TARGET_PARAMS], 0)


@EXAMPLES
@given(suffixes=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=40), min_size=1, max_size=5),
       others=st.lists(st.tuples(sequence, st.lists(st.integers(0, VOCAB - 1), max_size=40)), max_size=3))
def test_items_over_a_shared_prefix_give_the_same_bits_in_any_batch(invariant, suffixes, others):
    if not invariant.shares_prefixes:
        pytest.skip("this architecture scores every prompt from scratch (sliding window): covered above")
    model, pad, plan = invariant.model, invariant.pad_token_id, invariant.plan
    query, item = TARGET[:20], tuple(TARGET[20:])

    def logits(prefixes, pairs):
        states = dict(zip(map(tuple, prefixes), prefill_prefixes(model, plan, prefixes, pad)))
        rows = [SuffixRow(states[tuple(p)], tuple(s), min(2, len(s) + 1)) for p, s in pairs]
        return head_logits(plan, forward_suffixes(model, plan, rows, pad)).split([r.keep for r in rows])

    alone = logits([query], [(query, item)])[0]  # a cache miss, prefilled alone
    prefixes = [query] + [p for p, _ in others if tuple(p) != tuple(query)]
    pairs = [(p, tuple(s)) for p, s in others] + [(query, tuple(s)) for s in suffixes] + [(query, item)]
    # prefilled with other prefixes: the states a cache hit from that earlier batch would hand back
    assert torch.equal(logits(prefixes, pairs)[-1], alone)


def test_the_check_switches_off_a_path_that_is_not_invariant(tmp_path, monkeypatch):
    folder = make_tiny_model(tmp_path / "llama", "llama", max_positions=MAX_POSITIONS)
    # the bug: shared-prefix passes left padded to the batch's longest prefix and suffix, as without invariance
    real = models.prefix.forward_suffixes

    def variant(model, plan, rows, pad_token_id):
        return real(model, replace(plan, batch_invariant=False), rows, pad_token_id)

    monkeypatch.setattr(models.selfcheck, "forward_suffixes", variant)
    loaded = load_model(str(folder), device="cpu", dtype="float32", cache_dir=None, batch_invariant=True)
    checks = {check.name: check for check in loaded.plan.checks}
    assert not checks["shared_prefix"].enabled and "not batch-invariant" in checks["shared_prefix"].reason
    assert not loaded.shares_prefixes and checks["batch_invariant"].enabled  # invariant without that path
