"""Batch invariance on SmolLM2-135M, float32 and bfloat16: a request's logits, labels, ranks and top-N are bit-identical
(==) alone and in random batches of other requests, over a shared prefix too, and whether its prefix states come
from a prefill alone (a cache hit) or with other prefixes (a miss)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sampler
from models import forward_logits, load_model
from models.head import head_logits
from models.prefix import SuffixRow, forward_suffixes, prefill_prefixes
from sampler import LogprobsMode, SamplingParams

EXAMPLES = settings(max_examples=3, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TARGET = [(37 * i + 1000) % 40000 for i in range(60)]
PARAMS = SamplingParams(label_token_ids=(7042, 4528, 260), top_logprobs=5)

tokens = st.lists(st.integers(100, 40000), min_size=1, max_size=150)
# a batch of 160 to 1000+ tokens: bfloat16 kernels change their summation order within that range of rows
long_tokens = st.lists(st.integers(100, 40000), min_size=100, max_size=300)
neighbour = st.tuples(long_tokens, st.sampled_from(list(LogprobsMode)), st.sampled_from([None, 0.5, 2.0]))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def invariant_real(request, default_model_cache):
    return load_model("smollm2-135m", device="cpu", dtype=request.param, cache_dir=default_model_cache,
                      batch_invariant=True)


def test_the_self_check_proves_invariance(invariant_real):
    paths = {check.name: check for check in invariant_real.plan.checks}
    assert invariant_real.plan.batch_invariant and paths["batch_invariant"].difference == 0.0
    assert paths["packed_batches"].enabled and paths["shared_prefix"].enabled  # invariant without losing a path


@EXAMPLES
@given(before=st.lists(neighbour, min_size=1, max_size=3), after=st.lists(neighbour, max_size=3))
def test_a_request_gives_the_same_bits_in_any_batch(invariant_real, before, after):
    model, pad, plan = invariant_real.model, invariant_real.pad_token_id, invariant_real.plan
    alone = forward_logits(model, plan, [TARGET], pad)  # [1, V]
    sequences = [n[0] for n in before] + [TARGET] + [n[0] for n in after]
    logits = forward_logits(model, plan, sequences, pad)  # [B, V]
    assert torch.equal(logits[len(before)], alone[0])
    params = [SamplingParams(logprobs_mode=m, temperature=t, label_token_ids=(1,), top_logprobs=2)
              for _, m, t in before] + [PARAMS] + [
              SamplingParams(logprobs_mode=m, temperature=t, top_logprobs=4) for _, m, t in after]
    batched = sampler.to_rows(sampler.score(logits, params), params)[len(before)]
    assert batched == sampler.to_rows(sampler.score(alone, [PARAMS]), [PARAMS])[0]


@EXAMPLES
@given(items=st.lists(st.lists(st.integers(100, 40000), min_size=1, max_size=40), min_size=1, max_size=6),
       other_query=tokens)
def test_items_over_a_shared_prefix_give_the_same_bits_in_any_batch(invariant_real, items, other_query):
    model, pad, plan = invariant_real.model, invariant_real.pad_token_id, invariant_real.plan
    query, item = TARGET[:45], tuple(TARGET[45:])

    def last_logits(prefixes, pairs):
        states = dict(zip(map(tuple, prefixes), prefill_prefixes(model, plan, prefixes, pad)))
        return head_logits(plan, forward_suffixes(model, plan, [SuffixRow(states[tuple(p)], s) for p, s in pairs], pad))

    alone = last_logits([query], [(query, item)])[0]
    batched = last_logits([other_query, query], [(other_query, tuple(items[0]))] + [(query, tuple(s)) for s in items]
                          + [(query, item)])[-1]
    assert torch.equal(batched, alone)
