"""Fitting a label set's calibration: temperature scaling, optionally with per-label biases kept only when they lower
the cross-validated log loss; and the measures it is judged by (expected calibration error, log loss, accuracy).

With biases a small set is often separable by a threshold, and plain maximum likelihood then drives the temperature
to zero (certainty everywhere, ruinous on the first held-out mistake). A weak Gaussian prior on the log-temperature
and on the shifts (in nats, before scaling) keeps the fit finite; with many examples it fades away."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

ECE_BINS = 15
_FLOOR = -1e4  # a label at -inf (every form filtered) stays out of reach without making the loss infinite
_PRIOR_LOG_TEMPERATURE_SD = 1.0  # a temperature between e^-2 and e^2 is plausible a priori
_PRIOR_SHIFT_SD = 2.0  # nats


@dataclass(frozen=True)
class Fit:
    temperature: float
    biases: list[float]  # one per label, the first 0.0 (a shared shift changes nothing)


def _logits(logprobs: torch.Tensor, log_temperature: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """(logprobs + shift) / T, [N, L]; the first label's shift is 0 (a shift shared by all labels changes nothing)."""
    shift = torch.cat([shifts.new_zeros(1), shifts])  # [L]
    return (logprobs.clamp(min=_FLOOR) + shift) / log_temperature.exp()


def fit(logprobs: list[list[float]], gold: list[int], with_biases: bool) -> Fit:
    """Minimize the log loss of softmax((logprobs + shift) / T) over the examples ([N, L] label logprobs, gold [N])
    plus the prior's penalty; the biases reported are shift / T, as the server applies them (logprobs / T + bias)."""
    z = torch.tensor(logprobs, dtype=torch.float64)
    y = torch.tensor(gold)
    log_temperature = torch.zeros((), dtype=torch.float64, requires_grad=True)
    shifts = torch.zeros(z.shape[1] - 1, dtype=torch.float64, requires_grad=with_biases)
    params = [log_temperature] + ([shifts] if with_biases else [])
    optimizer = torch.optim.LBFGS(params, lr=1.0, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                                  line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        penalty = ((log_temperature / _PRIOR_LOG_TEMPERATURE_SD) ** 2 + ((shifts / _PRIOR_SHIFT_SD) ** 2).sum()) / 2
        loss = torch.nn.functional.cross_entropy(_logits(z, log_temperature, shifts), y) + penalty / len(gold)
        loss.backward()
        return loss

    optimizer.step(closure)
    temperature = math.exp(log_temperature.item())
    return Fit(temperature, [0.0] + [s / temperature for s in shifts.detach().tolist()])


def apply(fitted: Fit, logprobs: list[list[float]]) -> list[list[float]]:
    """softmax(logprobs / T + bias) per example, as the server computes a calibrated request."""
    z = torch.tensor(logprobs, dtype=torch.float64).clamp(min=_FLOOR)
    return torch.softmax(z / fitted.temperature + torch.tensor(fitted.biases, dtype=torch.float64), -1).tolist()


def uncalibrated(logprobs: list[list[float]]) -> list[list[float]]:
    return apply(Fit(1.0, [0.0] * len(logprobs[0])), logprobs)


def cross_validated_loss(logprobs: list[list[float]], gold: list[int], with_biases: bool, folds: int = 5,
                         seed: int = 0) -> float:
    """Mean held-out log loss over `folds` folds of the fitting examples."""
    order = list(range(len(gold)))
    random.Random(seed).shuffle(order)
    losses = []
    for k in range(folds):
        held = set(order[k::folds])
        train = [i for i in order if i not in held]
        fitted = fit([logprobs[i] for i in train], [gold[i] for i in train], with_biases)
        losses.append(log_loss(apply(fitted, [logprobs[i] for i in held]), [gold[i] for i in held]))
    return math.fsum(losses) / folds


@dataclass(frozen=True)
class Measures:
    ece: float
    log_loss: float
    accuracy: float


def log_loss(probabilities: list[list[float]], gold: list[int]) -> float:
    return -math.fsum(math.log(max(p[g], 1e-300)) for p, g in zip(probabilities, gold)) / len(gold)


def reliability_bins(probabilities: list[list[float]], gold: list[int], bins: int = ECE_BINS
                     ) -> list[tuple[float, float, int]]:
    """Per equal-width confidence bin: (mean confidence, accuracy, count), confidence being the top probability."""
    sums = [[0.0, 0.0, 0] for _ in range(bins)]
    for p, g in zip(probabilities, gold):
        confidence = max(p)
        top = p.index(confidence)
        b = min(int(confidence * bins), bins - 1)
        sums[b][0] += confidence
        sums[b][1] += top == g
        sums[b][2] += 1
    return [(c / n, a / n, n) if n else (0.0, 0.0, 0) for c, a, n in sums]


def measures(probabilities: list[list[float]], gold: list[int]) -> Measures:
    n = len(gold)
    bins = reliability_bins(probabilities, gold)
    ece = math.fsum(count / n * abs(accuracy - confidence) for confidence, accuracy, count in bins)
    accuracy = sum(p.index(max(p)) == g for p, g in zip(probabilities, gold)) / n
    return Measures(ece, log_loss(probabilities, gold), accuracy)
