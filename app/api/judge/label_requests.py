"""A request's label set on any route: resolved (by name or inline), bound to the served tokenizer on the tokenizer
thread, checked against the logprobs mode and the calibration it asks for, and its answer written for the wire."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.api.common import finite
from app.api.front import Front
from app.api.judge.calibration import Calibration
from app.api.judge.label_scores import LabelScores, summarize
from app.api.judge.label_sets import BoundLabelSet, bind_label_set, resolve_label_set
from app.engine.core import Engine
from app.errors import InvalidRequestError
from sampler import LogprobsMode


@dataclass(frozen=True)
class RequestLabels:
    """A request's bound label set, and the calibration its probabilities go through (None: uncalibrated)."""

    bound: BoundLabelSet
    calibration: Calibration | None


def logprobs_mode_of(engine: Engine, requested: LogprobsMode | str | None) -> LogprobsMode:
    """The mode a request runs under; a label set needs logprobs (a log-sum-exp of logits is no probability)."""
    mode = LogprobsMode(requested or engine.settings.default_logprobs_mode)
    if not mode.is_logprobs:
        raise InvalidRequestError(f"a label set needs a logprobs mode (raw_logprobs or processed_logprobs), not "
                                  f"{mode.value}", "logprobs_mode")
    return mode


async def request_labels(front: Front, spec: str | Mapping, mode: LogprobsMode, calibrated: bool,
                         param: str = "labels") -> RequestLabels:
    """Resolve and bind `spec`; with `calibrated`, the named set's calibration under the same logprobs mode."""
    settings, loaded = front.engine.settings, front.engine.loaded
    label_set = resolve_label_set(spec, settings.label_set_definitions, param)
    bound = await front.on_tokenizer_thread(bind_label_set, label_set, loaded.tokenizer, loaded.vocab_size,
                                            settings.max_candidates, param)
    calibration = None
    if calibrated:
        calibration = settings.calibrations.get(label_set.name) if label_set.name is not None else None
        if calibration is None:
            what = f"label set {label_set.name!r}" if label_set.name else "a label set sent inline"
            raise InvalidRequestError(f"the server has no calibration for {what} (--calibration)", "calibrated")
        if calibration.logprobs_mode != mode.value:
            raise InvalidRequestError(f"the calibration of {label_set.name!r} was fitted under "
                                      f"{calibration.logprobs_mode}, not {mode.value}", "calibrated")
    return RequestLabels(bound, calibration)


def label_fields(labels: RequestLabels, scores: LabelScores) -> dict:
    """The label set's fields of one data entry: per label its numbers, then the summary of the distribution that
    `scores` reports (the calibrated one when asked)."""
    label_set = labels.bound.label_set
    distribution = scores.distribution
    calibrated = None
    if labels.calibration is not None:
        calibrated = labels.calibration.probabilities(scores.logprobs)
        distribution = summarize(calibrated, label_set.labels, label_set.values)
    per_label = []
    for i, label in enumerate(label_set.labels):
        entry = {"label": label, "logprob": finite(scores.logprobs[i]),
                 "probability": scores.distribution.probabilities[i],
                 "form_logprobs": [finite(v) for v in scores.form_logprobs[i]]}
        if calibrated is not None:
            entry["calibrated_probability"] = calibrated[i]
        per_label.append(entry)
    return {"scores": distribution.probabilities, "labels": per_label, "prediction": distribution.prediction,
            "margin": distribution.margin, "entropy": distribution.entropy,
            "expected_value": distribution.expected_value, "calibrated": labels.calibration is not None}
