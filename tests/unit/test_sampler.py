"""Unit tests for sampler/: mode definitions, processors, the snapshot invariant, batch independence, sampling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sampler import (
    LogprobsMode,
    RowScores,
    SamplingParams,
    ScoreOutput,
    process,
    sample,
    score,
    snapshot,
    to_rows,
)
from sampler.sampling import inverse_cdf

NEG_INF = float("-inf")
MODES = list(LogprobsMode)
PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- plain per-row reference


def ref_process_row(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The processors written one row at a time, straight from their definitions. row: [V]."""
    y = row.to(torch.float32).clone()
    for tok, bias in p.logit_bias:
        y[tok] = y[tok] + bias
    if p.temperature is not None and p.temperature > 0:
        y = y / p.temperature
    if p.min_p:
        probs = torch.softmax(y, dim=-1)
        y[probs < probs.max() * torch.tensor(p.min_p, dtype=torch.float32)] = NEG_INF
    if p.top_k is not None and p.top_k > 0:
        ordered = sorted(y.tolist(), reverse=True)
        kth = ordered[min(p.top_k, len(ordered)) - 1]
        y[y < kth] = NEG_INF
    if p.top_p is not None and p.top_p < 1.0:
        probs = torch.softmax(y, dim=-1)
        ordered = sorted(probs.tolist(), reverse=True)
        mass, n = 0.0, 0
        for q in ordered:  # smallest prefix whose running sum reaches top_p
            n += 1
            mass += q
            if mass >= p.top_p:
                break
        y[probs < ordered[n - 1]] = NEG_INF
    return y


def ref_snapshot_row(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    mode = p.logprobs_mode
    y = ref_process_row(row, p) if mode.is_processed else row.to(torch.float32).clone()
    return torch.log_softmax(y, dim=-1) if mode.is_logprobs else y


def ref_row_scores(snap_row: torch.Tensor, p: SamplingParams) -> RowScores:
    vals = snap_row.tolist()
    labels = [vals[t] for t in p.label_token_ids]
    ranks = [1 + sum(1 for v in vals if v > lv) for lv in labels]
    order = sorted(range(len(vals)), key=lambda i: (-vals[i], i))[: p.top_logprobs]
    return RowScores(labels, ranks, order, [vals[i] for i in order])


# ---------------------------------------------------------------- strategies

TIE_VALUES = [-3.0, -1.0, 0.0, 0.0, 0.5, 2.0, 2.0]


@st.composite
def logits_st(draw, max_batch=5, max_vocab=12):
    b = draw(st.integers(1, max_batch))
    v = draw(st.integers(1, max_vocab))
    if draw(st.booleans()):
        # few distinct values: lots of ties, sometimes a -inf token
        pool = TIE_VALUES + ([NEG_INF] if draw(st.booleans()) else [])
        vals = draw(st.lists(st.sampled_from(pool), min_size=b * v, max_size=b * v))
    else:
        vals = draw(st.lists(st.floats(-20, 20, width=32), min_size=b * v, max_size=b * v))
    x = torch.tensor(vals, dtype=torch.float32).view(b, v)
    x[:, 0] = torch.where(torch.isinf(x[:, 0]), torch.zeros(()), x[:, 0])  # every row keeps a finite token
    return x


@st.composite
def params_st(draw, vocab: int, mode=None):
    ids = st.integers(0, vocab - 1)
    bias_ids = draw(st.lists(ids, max_size=3, unique=True))
    return SamplingParams(
        logprobs_mode=mode if mode is not None else draw(st.sampled_from(MODES)),
        temperature=draw(st.one_of(st.none(), st.just(0.0), st.just(1.0), st.floats(0.1, 3.0))),
        top_k=draw(st.one_of(st.none(), st.sampled_from([0, -1]), st.integers(1, vocab + 2))),
        top_p=draw(st.one_of(st.none(), st.just(1.0), st.floats(0.01, 1.0))),
        min_p=draw(st.one_of(st.none(), st.just(0.0), st.floats(0.0, 1.0))),
        logit_bias=tuple((t, draw(st.sampled_from([-5.0, -0.5, 0.5, 3.0]))) for t in bias_ids),
        label_token_ids=tuple(draw(st.lists(ids, max_size=6))),
        top_logprobs=draw(st.integers(0, vocab + 2)),
    )


@st.composite
def batch_st(draw, max_batch=5, max_vocab=12):
    x = draw(logits_st(max_batch, max_vocab))
    params = [draw(params_st(x.shape[1])) for _ in range(x.shape[0])]
    return x, params


def same(a: list[float], b: list[float]) -> bool:
    """Bit-level equality of float lists (-inf == -inf, and 0.0 vs -0.0 told apart)."""
    return len(a) == len(b) and all(math.copysign(1, x) == math.copysign(1, y) and x == y for x, y in zip(a, b))


# ---------------------------------------------------------------- mode definitions


@given(batch_st())
@PROPS
def test_snapshot_matches_per_row_reference(case):
    x, params = case
    snap = snapshot(x, params)
    assert snap.dtype == torch.float32 and snap.shape == x.shape
    for r, p in enumerate(params):
        assert torch.equal(snap[r], ref_snapshot_row(x[r], p)), (r, p)


@given(batch_st())
@PROPS
def test_score_matches_per_row_reference(case):
    x, params = case
    rows = to_rows(score(x, params), params)
    snap = snapshot(x, params)
    for r, p in enumerate(params):
        want = ref_row_scores(snap[r], p)
        got = rows[r]
        assert same(got.label_values, want.label_values)
        assert got.label_ranks == want.label_ranks
        assert got.top_ids == want.top_ids
        assert same(got.top_values, want.top_values)


def test_raw_modes_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    lse = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    p = SamplingParams(temperature=0.5, top_k=1, top_p=0.1, min_p=0.9, logit_bias=((0, 9.0),))
    raw = snapshot(x, [p])[0].tolist()  # raw_logprobs ignores every processor
    assert raw == pytest.approx([1 - lse, 2 - lse, 3 - lse], abs=1e-6)
    raw_logits = snapshot(x, [SamplingParams(logprobs_mode="raw_logits", top_k=1)])
    assert torch.equal(raw_logits, x)


def test_temperature_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    for mode in (LogprobsMode.PROCESSED_LOGITS, LogprobsMode.PROCESSED_LOGPROBS):
        out = snapshot(x, [SamplingParams(logprobs_mode=mode, temperature=2.0)])[0].tolist()
        if mode is LogprobsMode.PROCESSED_LOGITS:
            assert out == [0.5, 1.0, 1.5]
        else:
            lse = math.log(math.exp(0.5) + math.exp(1.0) + math.exp(1.5))
            assert out == pytest.approx([0.5 - lse, 1.0 - lse, 1.5 - lse], abs=1e-6)


def test_top_k_by_hand_keeps_ties():
    x = torch.tensor([[1.0, 3.0, 2.0, 5.0], [1.0, 3.0, 3.0, 5.0]])
    p = SamplingParams(logprobs_mode="processed_logits", top_k=2)
    out = process(x, [p, p])
    assert out[0].tolist() == [NEG_INF, 3.0, NEG_INF, 5.0]
    assert out[1].tolist() == [NEG_INF, 3.0, 3.0, 5.0]  # both tokens tied with the 2nd value stay
    assert torch.equal(process(x, [SamplingParams(top_k=10)] * 2), x)  # k >= V keeps all


def test_top_p_by_hand():
    probs = [0.5, 0.3, 0.15, 0.05]
    x = torch.tensor([probs]).log()
    kept = lambda top_p: torch.isfinite(process(x, [SamplingParams(top_p=top_p)])[0]).tolist()  # noqa: E731
    assert kept(0.4) == [True, False, False, False]
    assert kept(0.75) == [True, True, False, False]
    assert kept(0.85) == [True, True, True, False]
    assert kept(0.99) == [True, True, True, True]
    # processed logprobs renormalise over the kept set
    lp = snapshot(x, [SamplingParams(logprobs_mode="processed_logprobs", top_p=0.75)])[0].tolist()
    assert lp[:2] == pytest.approx([math.log(0.5 / 0.8), math.log(0.3 / 0.8)], abs=1e-6)
    assert lp[2:] == [NEG_INF, NEG_INF]


def test_top_p_ties_at_threshold_all_kept():
    x = torch.tensor([[2.0, 0.0, 2.0, 2.0]])  # three tied tokens hold ~0.96 of the mass
    out = process(x, [SamplingParams(top_p=0.5)])[0]
    assert torch.isfinite(out).tolist() == [True, False, True, True]


def test_top_p_wide_nucleus_matches_reference():
    # a flat row forces top_p past its first topk width towards the full sort
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 12000, generator=gen) * 0.1
    params = [SamplingParams(top_p=0.97), SamplingParams(top_p=0.3), SamplingParams(top_p=0.999999)]
    out = process(x, params)
    for r, p in enumerate(params):
        assert torch.equal(out[r], ref_process_row(x[r], p))


def test_min_p_by_hand():
    x = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = process(x, [SamplingParams(min_p=0.2)])[0]  # drop prob < 0.2 * 0.5 = 0.1
    assert torch.isfinite(out).tolist() == [True, True, True, False]
    out = process(x, [SamplingParams(min_p=1.0)])[0]
    assert torch.isfinite(out).tolist() == [True, False, False, False]


def test_logit_bias_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    out = process(x, [SamplingParams(logit_bias=((0, 5.0), (2, -1.0)))])
    assert out.tolist() == [[6.0, 2.0, 2.0]]


def test_processor_order_bias_then_temperature_then_filters():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    p = SamplingParams(logit_bias=((0, 10.0),), temperature=2.0, top_k=1)
    assert process(x, [p]).tolist() == [[5.0, NEG_INF, NEG_INF, NEG_INF]]


def test_filters_see_the_renormalised_output_of_earlier_filters():
    x = torch.tensor([[0.5, 0.3, 0.2]]).log()
    kept = lambda p: torch.isfinite(process(x, [p])[0]).tolist()  # noqa: E731
    assert kept(SamplingParams(top_p=0.6)) == [True, True, False]
    # min_p (0.2 < 0.5 * 0.5) runs before top_p: 0.5 / 0.8 = 0.625 already reaches 0.6
    assert kept(SamplingParams(min_p=0.5, top_p=0.6)) == [True, False, False]
    # the same for top_k before top_p
    assert kept(SamplingParams(top_k=2, top_p=0.6)) == [True, False, False]
    # temperature before min_p: at T=4 every token is within 0.5x of the max
    assert kept(SamplingParams(temperature=4.0, min_p=0.5)) == [True, True, True]


def test_processed_modes_without_processors_equal_raw():
    x = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    for proc, raw in [("processed_logprobs", "raw_logprobs"), ("processed_logits", "raw_logits")]:
        p = SamplingParams(logprobs_mode=proc, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
        assert not p.needs_processing
        assert torch.equal(snapshot(x, [p, p]), snapshot(x, [SamplingParams(logprobs_mode=raw)] * 2))


def test_low_precision_input_works_in_float32():
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(logprobs_mode=m, top_k=5, label_token_ids=(1, 2), top_logprobs=3) for m in MODES[:3]]
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        out = score(low, params)
        assert out.label_values.dtype == torch.float32 and out.top_values.dtype == torch.float32
        assert to_rows(out, params) == to_rows(score(low.float(), params), params)


# ---------------------------------------------------------------- the central invariant


@given(batch_st())
@PROPS
def test_invariants_hold_in_every_mode(case):
    x, params = case
    out = score(x, params)
    assert isinstance(out, ScoreOutput)
    batch = x.shape[0]
    assert out.label_values.shape[0] == out.top_ids.shape[0] == batch
    assert out.label_ranks.dtype == torch.long and out.top_ids.dtype == torch.long
    for r, (row, p) in enumerate(zip(to_rows(out, params), params)):
        assert len(row.label_values) == len(p.label_token_ids)
        assert len(row.top_ids) == min(p.top_logprobs, x.shape[1])
        # top values sorted desc, ties by lower id first
        pairs = list(zip(row.top_values, row.top_ids))
        assert all(a[0] > b[0] or (a[0] == b[0] and a[1] < b[1]) for a, b in zip(pairs, pairs[1:]))
        # a label that is also in the top list carries exactly the same number
        top = dict(zip(row.top_ids, row.top_values))
        for tok, value, rank in zip(p.label_token_ids, row.label_values, row.label_ranks):
            if tok in top:
                assert same([value], [top[tok]])
                assert rank <= row.top_ids.index(tok) + 1
        # ranks of the top list tokens, scored as labels, agree with the top list order
        as_labels = SamplingParams(
            logprobs_mode=p.logprobs_mode,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            logit_bias=p.logit_bias,
            label_token_ids=tuple(row.top_ids),
        )
        ranked = to_rows(score(x[r : r + 1], [as_labels]), [as_labels])[0]
        assert same(ranked.label_values, row.top_values)
        assert all(rank <= i + 1 for i, rank in enumerate(ranked.label_ranks))


@given(batch_st())
@PROPS
def test_kept_set_is_closed_upwards(case):
    x, params = case
    processed = process(x, params)
    for r, p in enumerate(params):
        # values after the order-preserving processors (bias, temperature), before any filter
        before = ref_process_row(
            x[r], SamplingParams(logit_bias=p.logit_bias, temperature=p.temperature)
        )
        kept = torch.isfinite(processed[r])
        assert kept[before.argmax()]  # the max token always survives
        if (~kept).any() and kept.any():
            # strict: a token tied with a kept token is never filtered
            assert before[~kept].max() < before[kept].min()


# ---------------------------------------------------------------- batch independence and purity


@given(batch_st(max_batch=6))
@PROPS
def test_row_alone_equals_row_in_mixed_batch(case):
    x, params = case
    together = to_rows(score(x, params), params)
    snap = snapshot(x, params)
    for r, p in enumerate(params):
        alone = to_rows(score(x[r : r + 1], [p]), [p])[0]
        assert alone.label_ranks == together[r].label_ranks and alone.top_ids == together[r].top_ids
        assert same(alone.label_values, together[r].label_values)
        assert same(alone.top_values, together[r].top_values)
        assert torch.equal(snapshot(x[r : r + 1], [p])[0], snap[r])


def test_batch_independence_at_real_vocab_size():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4096, generator=gen) * 4
    labels = (5, 17, 4000, 5)
    params = [
        SamplingParams(label_token_ids=labels, top_logprobs=20),
        SamplingParams(logprobs_mode="processed_logprobs", temperature=0.7, top_p=0.9, label_token_ids=labels),
        SamplingParams(logprobs_mode="processed_logits", top_k=40, top_p=0.5, top_logprobs=50),
        SamplingParams(logprobs_mode="raw_logits", top_logprobs=5, temperature=3.0),
        SamplingParams(logprobs_mode="processed_logprobs", min_p=0.05, logit_bias=((17, 4.0),), top_logprobs=5),
        SamplingParams(logprobs_mode="processed_logprobs", top_p=0.999, label_token_ids=labels, top_logprobs=3),
        SamplingParams(label_token_ids=tuple(range(0, 4096, 64))),  # > 48 labels: the sort-based rank path
        SamplingParams(),
    ]
    together = to_rows(score(x, params), params)
    for r, p in enumerate(params):
        assert to_rows(score(x[r : r + 1], [p]), [p])[0] == together[r]
        for sub in ([r, 0], [7, r, 2]):  # other neighbours, other positions
            rows = to_rows(score(x[sub], [params[i] for i in sub]), [params[i] for i in sub])
            assert rows[sub.index(r)] == together[r]
    # many-label ranks agree with the direct count
    snap = snapshot(x, params)
    want = [1 + int((snap[6] > snap[6, t]).sum()) for t in params[6].label_token_ids]
    assert together[6].label_ranks == want


def test_input_logits_never_modified():
    gen = torch.Generator().manual_seed(4)
    p_all = [
        SamplingParams(logprobs_mode=m, temperature=0.5, top_k=3, top_p=0.8, min_p=0.1,
                       logit_bias=((1, 2.0),), label_token_ids=(0, 1), top_logprobs=3)
        for m in MODES
    ]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 30, generator=gen).to(dtype)
        before = x.clone()
        score(x, p_all)
        process(x, p_all)
        sample(x, p_all, [torch.Generator().manual_seed(i) for i in range(4)])
        snap = snapshot(x, p_all)
        snap.fill_(7.0)  # a raw_logits snapshot must not alias the caller's tensor
        assert torch.equal(x, before)
        only_logits = [SamplingParams(logprobs_mode="raw_logits")] * 4
        snapshot(x, only_logits).fill_(7.0)
        assert torch.equal(x, before)


def test_to_rows_slices_each_row_and_handles_empty_requests():
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(label_token_ids=(1, 2, 3), top_logprobs=0),
        SamplingParams(top_logprobs=10),  # more than V: capped at V
        SamplingParams(logprobs_mode="raw_logits", label_token_ids=(4,), top_logprobs=2),
    ]
    out = score(x, params)
    assert out.label_values.shape == (3, 3) and out.top_ids.shape == (3, 6)
    rows = to_rows(out, params)
    assert [len(r.label_values) for r in rows] == [3, 0, 1]
    assert [len(r.top_ids) for r in rows] == [0, 6, 2]
    assert sorted(rows[1].top_ids) == list(range(6))
    empty = score(x, [SamplingParams()] * 3)
    assert empty.label_values.shape == (3, 0) and empty.top_ids.shape == (3, 0)
    assert to_rows(empty, [SamplingParams()] * 3) == [RowScores([], [], [], [])] * 3


def test_top_list_tie_break_prefers_lower_ids():
    x = torch.tensor([[1.0, 5.0, 1.0, 1.0, 5.0, 1.0]])
    p = SamplingParams(logprobs_mode="raw_logits", top_logprobs=4, label_token_ids=(5, 0, 1))
    row = to_rows(score(x, [p]), [p])[0]
    assert row.top_ids == [1, 4, 0, 2]
    assert row.label_ranks == [3, 3, 1]


# ---------------------------------------------------------------- sampling


def test_greedy_is_argmax_of_processed_logits():
    x = torch.randn(5, 100, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)),
        SamplingParams(logit_bias=((3, 50.0),), top_k=2),
        SamplingParams(top_p=0.5),
    ]
    tokens = sample(x, params, [None] * 5)
    assert tokens.dtype == torch.long and tokens.shape == (5,)
    assert tokens.tolist() == process(x, params).argmax(dim=-1).tolist()
    assert tokens[0] == x[0].argmax() and tokens[2] == 7 and tokens[3] == 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours():
    x = torch.randn(4, 500, generator=_gen(7))
    p = SamplingParams(temperature=1.5, top_p=0.95)
    alone = [sample(x[0:1], [p], [_gen(42)]).item() for _ in range(3)]
    assert len(set(alone)) == 1
    neighbours = [SamplingParams(temperature=0.8), SamplingParams(), SamplingParams(temperature=2.0, top_k=5)]
    for order in ([0, 1, 2, 3], [3, 2, 0, 1]):
        params = [p if i == 0 else neighbours[i - 1] for i in order]
        gens = [_gen(42) if i == 0 else (_gen(i) if i != 2 else None) for i in order]
        tokens = sample(x[order], params, gens)
        assert tokens[order.index(0)].item() == alone[0]
    # a sequence of draws from one generator is reproducible too
    seq = lambda: [sample(x[0:1], [p], [g]).item() for g in [_gen(9)] for _ in range(5)]  # noqa: E731
    assert seq() == seq()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    x = probs.log().expand(4000, 4).contiguous()
    tokens = sample(x, [SamplingParams(temperature=1.0)] * 4000, [_gen(1000 + r) for r in range(4000)])
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert freq[3] == 0
    assert torch.allclose(freq, probs, atol=0.04)


def test_inverse_cdf_edges_never_pick_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 4)
    below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    # u = 0 takes the first positive token; u just under 1 the last positive one, never a zero after it
    u = torch.tensor([0.0, 0.2499, 0.25, below_one.item()], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]
    # a total that rounds: many tiny probabilities in float32, the last token at zero
    tiny = torch.full((1, 49152), 1e-3)
    tiny[0, -1] = 0.0
    assert inverse_cdf(tiny, below_one.view(1)).item() == 49150


@pytest.mark.parametrize("vocab,block", [(7, 4), (64, 8), (1000, 256), (50257, 256)])
def test_inverse_cdf_in_blocks_equals_one_running_sum(vocab, block):
    gen = _gen(vocab)
    probs = torch.softmax(torch.randn(64, vocab, generator=gen) * 4, dim=-1)
    probs[:, ::3] = 0.0
    u = torch.rand(64, dtype=torch.float64, generator=gen)
    u[:2] = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    running = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [64, V]
    expected = torch.searchsorted(running, (u * running[:, -1]).unsqueeze(1), right=True).squeeze(1)
    assert torch.equal(inverse_cdf(probs, u, block), expected)


@given(batch_st(), st.integers(0, 2**31 - 1))
@PROPS
def test_never_samples_a_filtered_token(case, seed):
    x, params = case
    processed = process(x, params)
    gens = [_gen(seed + r) if r % 2 == 0 else None for r in range(len(params))]
    tokens = sample(x, params, gens).tolist()
    for r, (tok, p) in enumerate(zip(tokens, params)):
        assert processed[r, tok] > NEG_INF
        if p.is_greedy:
            assert tok == processed[r].argmax().item()


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logprobs_mode": "logprobs"},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": "1"},
        {"top_k": -2},
        {"top_k": 2.5},
        {"top_k": True},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -0.1},
        {"min_p": -0.01},
        {"min_p": 1.01},
        {"logit_bias": ((1, float("inf")),)},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": ((1, 1.0), (1, 2.0))},
        {"logit_bias": (1, 2)},
        {"label_token_ids": (1, -3)},
        {"label_token_ids": (1.5,)},
        {"label_token_ids": "12"},
        {"top_logprobs": -1},
        {"top_logprobs": 1.0},
    ],
)
def test_invalid_params_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_normalise_and_report_processing():
    p = SamplingParams(logprobs_mode="processed_logits", temperature=1, logit_bias={3: 1}, label_token_ids=[1, 1])
    assert p.logprobs_mode is LogprobsMode.PROCESSED_LOGITS
    assert p.logit_bias == ((3, 1.0),) and p.label_token_ids == (1, 1) and p.temperature == 1.0
    assert p.needs_processing and hash(p) == hash(SamplingParams(**{**p.__dict__}))
    assert not SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0).needs_processing
    assert SamplingParams(top_k=3).needs_processing and SamplingParams(min_p=0.1).needs_processing


def test_bad_batches_raise_value_error():
    x = torch.zeros(2, 5)
    with pytest.raises(ValueError):
        score(x, [SamplingParams()])  # one params per row
    with pytest.raises(ValueError):
        score(x[0], [SamplingParams()])  # [V] is not [B, V]
    with pytest.raises(ValueError):
        score(x, [SamplingParams(label_token_ids=(5,)), SamplingParams()])  # id outside vocab
    with pytest.raises(ValueError):
        process(x, [SamplingParams(logit_bias=((9, 1.0),)), SamplingParams()])
    with pytest.raises(ValueError):
        score(torch.zeros(2, 5, dtype=torch.long), [SamplingParams()] * 2)
    with pytest.raises(ValueError):
        sample(x, [SamplingParams()] * 2, [None])
    nan = x.clone()
    nan[1, 2] = float("nan")
    with pytest.raises(ValueError):
        score(nan, [SamplingParams(top_logprobs=2)] * 2)
