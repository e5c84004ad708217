"""A label set's answer at one prompt: each label's logprob (the log-sum-exp of its surface forms), the distribution
over the labels, its argmax, margin and entropy, and the expected value of a numeric scale."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from app.api.judge.label_sets import BoundLabelSet


def log_sum_exp(values: Sequence[float]) -> float:
    """log(sum(exp(v))) without overflow; -inf when every value is -inf (every form filtered)."""
    top = max(values)
    if top == -math.inf:
        return -math.inf
    return top + math.log(math.fsum(math.exp(v - top) for v in values))


def normalize(logprobs: Sequence[float]) -> list[float]:
    """Softmax over the labels; all labels at -inf have no distribution and get 0.0 each."""
    total = log_sum_exp(logprobs)
    if total == -math.inf:
        return [0.0] * len(logprobs)
    return [math.exp(v - total) for v in logprobs]


@dataclass(frozen=True)
class LabelDistribution:
    """The summary of one distribution over a label set."""

    probabilities: list[float]
    prediction: str | None  # the most probable label (the first on a tie); None when no label has mass
    margin: float | None  # its probability minus the runner-up's
    entropy: float | None  # in nats
    expected_value: float | None  # sum of p(label) x label for a numeric label set


def summarize(probabilities: list[float], labels: Sequence[str], values: Sequence[float] | None) -> LabelDistribution:
    if not any(probabilities):
        return LabelDistribution(probabilities, None, None, None, None)
    order = sorted(range(len(probabilities)), key=lambda i: -probabilities[i])  # stable: ties keep label order
    margin = probabilities[order[0]] - probabilities[order[1]]
    entropy = -math.fsum(p * math.log(p) for p in probabilities if p > 0)
    expected = math.fsum(p * v for p, v in zip(probabilities, values)) if values is not None else None
    return LabelDistribution(probabilities, labels[order[0]], margin, entropy, expected)


@dataclass(frozen=True)
class LabelScores:
    """One prompt's label set answer: per label its forms' values and its logprob, and the distribution."""

    form_logprobs: list[list[float]]  # [label][form]: the sum of the form's token logprobs
    logprobs: list[float]  # [label]: log-sum-exp of its forms
    distribution: LabelDistribution


def label_scores(bound: BoundLabelSet, candidate_values: list[list[float]]) -> LabelScores:
    """candidate_values[k]: each token's logprob of form k (the engine's candidate outcome) -> the label answer."""
    labels = bound.label_set.labels
    forms: list[list[float]] = [[] for _ in labels]
    for owner, values in zip(bound.owner, candidate_values):
        forms[owner].append(math.fsum(values))  # a filtered (-inf) token makes the form -inf
    logprobs = [log_sum_exp(f) for f in forms]
    return LabelScores(forms, logprobs, summarize(normalize(logprobs), labels, bound.label_set.values))
