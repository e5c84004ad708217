"""The arithmetic behind judging: windows that cover a document, Bradley-Terry strengths, log-sum-exp over forms,
the calibration fit and its measures."""

from __future__ import annotations

import math
import random

import pytest
import torch

from app.api.judge.bradley_terry import bradley_terry
from app.api.judge.label_scores import log_sum_exp, normalize, summarize
from app.api.rerank.windows import window_starts
from app.calibration_fit import apply, fit, measures, reliability_bins


@pytest.mark.parametrize(("length", "size", "stride"), [(10, 4, 3), (10, 4, 4), (9, 4, 1), (100, 30, 22), (5, 5, 2)])
def test_windows_cover_every_token_and_end_with_the_document(length, size, stride):
    starts = window_starts(length, size, stride)
    covered = set()
    for start in starts:
        covered |= set(range(start, min(start + size, length)))
    assert covered == set(range(length))
    assert starts[0] == 0 and starts[-1] + size >= length
    assert all(b - a <= stride for a, b in zip(starts, starts[1:]))


def test_bradley_terry_recovers_strengths_from_exact_probabilities():
    truth = [1.2, 0.3, -0.5, -1.0]
    mean = sum(truth) / len(truth)
    wins = {(i, j): 1 / (1 + math.exp(truth[j] - truth[i])) for i in range(4) for j in range(i + 1, 4)}
    assert bradley_terry(4, wins) == pytest.approx([t - mean for t in truth], abs=1e-8)


def test_log_sum_exp_and_normalize_keep_minus_infinity():
    assert log_sum_exp([-math.inf, -math.inf]) == -math.inf
    assert log_sum_exp([math.log(0.2), math.log(0.3)]) == pytest.approx(math.log(0.5))
    assert normalize([-math.inf, -math.inf]) == [0.0, 0.0]
    assert normalize([math.log(0.1), -math.inf, math.log(0.3)]) == pytest.approx([0.25, 0.0, 0.75])
    empty = summarize([0.0, 0.0], ["a", "b"], None)
    assert empty.prediction is None and empty.entropy is None
    rated = summarize([0.25, 0.75], ["1", "5"], (1.0, 5.0))
    assert (rated.prediction, rated.margin, rated.expected_value) == ("5", 0.5, 4.0)


def test_fit_recovers_a_known_temperature_and_bias():
    rng = random.Random(0)
    true_t, true_b = 2.0, [0.0, -0.7, 0.4]
    logprobs, gold = [], []
    for _ in range(6000):
        z = torch.log_softmax(torch.tensor([rng.gauss(0, 3) for _ in range(3)], dtype=torch.float64), 0)
        p = torch.softmax(z / true_t + torch.tensor(true_b, dtype=torch.float64), 0).tolist()
        logprobs.append(z.tolist())
        gold.append(rng.choices(range(3), p)[0])
    fitted = fit(logprobs, gold, with_biases=True)
    assert fitted.temperature == pytest.approx(true_t, rel=0.08)
    assert fitted.biases == pytest.approx(true_b, abs=0.12)
    only_t = fit(logprobs, gold, with_biases=False)
    assert only_t.biases == [0.0, 0.0, 0.0]
    assert measures(apply(fitted, logprobs), gold).log_loss < measures(apply(only_t, logprobs), gold).log_loss


def test_ece_by_hand():
    probabilities = [[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.3, 0.7]]
    gold = [0, 1, 0, 1]
    bins = reliability_bins(probabilities, gold)
    filled = [(c, a, n) for c, a, n in bins if n]
    assert filled == [(0.6, 1.0, 1), (0.7, 1.0, 1), (0.9, 0.5, 2)]
    # |1 - 0.6| / 4 + |1 - 0.7| / 4 + 2 |0.5 - 0.9| / 4
    assert measures(probabilities, gold).ece == pytest.approx(0.4 / 4 + 0.3 / 4 + 0.8 / 4)
    assert measures(probabilities, gold).accuracy == 0.75
