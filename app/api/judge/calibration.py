"""Calibration of a named label set: temperature scaling (and optionally per-label biases) fitted by `genscore
calibrate`, read from the server's calibration file and applied to a prompt's label logprobs."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from app.api.judge.label_scores import normalize
from app.api.judge.label_sets import LabelSet


@dataclass(frozen=True)
class Calibration:
    """p(label) = softmax(logprob / temperature + bias) over the labels of one set, under one logprobs mode."""

    labels: tuple[str, ...]
    temperature: float
    biases: tuple[float, ...]  # one per label (all 0.0 when only the temperature was fitted)
    logprobs_mode: str
    model: str
    report: dict = field(default_factory=dict)  # what `genscore calibrate` measured, kept for people to read

    def probabilities(self, logprobs: Sequence[float]) -> list[float]:
        return normalize([v / self.temperature + b if v != -math.inf else -math.inf
                          for v, b in zip(logprobs, self.biases)])

    def to_json(self) -> dict:
        body = asdict(self)
        body["labels"] = list(self.labels)
        body["biases"] = list(self.biases)
        return body


def parse_calibration(body: Mapping, where: str) -> Calibration:
    """One entry of a calibration file; ValueError naming `where` when a field is missing or out of range."""
    try:
        labels = tuple(body["labels"])
        temperature = float(body["temperature"])
        biases = tuple(float(b) for b in body["biases"])
        mode = str(body["logprobs_mode"])
        model = str(body.get("model", ""))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: needs labels, temperature, biases and logprobs_mode ({exc})") from None
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{where}: temperature must be a positive number, got {temperature}")
    if len(biases) != len(labels) or not all(math.isfinite(b) for b in biases):
        raise ValueError(f"{where}: biases must be one finite number per label")
    if mode not in ("raw_logprobs", "processed_logprobs"):
        raise ValueError(f"{where}: logprobs_mode must be raw_logprobs or processed_logprobs, got {mode!r}")
    return Calibration(labels, temperature, biases, mode, model, dict(body.get("report", {})))


def read_calibrations(path: Path, label_sets: Mapping[str, LabelSet]) -> dict[str, Calibration]:
    """The server's calibration file, {"label set name": calibration, ...}, each checked against its label set."""
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the calibration file {path}: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"calibration file {path} must be a JSON object keyed by label set name")
    calibrations = {}
    for name, body in spec.items():
        where = f"calibration file {path}, {name}"
        if name not in label_sets:
            raise ValueError(f"{where}: no label set of that name in the label-sets file")
        if not isinstance(body, Mapping):
            raise ValueError(f"{where}: must be an object")
        calibration = parse_calibration(body, where)
        if calibration.labels != label_sets[name].labels:
            raise ValueError(f"{where}: fitted for labels {list(calibration.labels)}, but the label set has "
                             f"{list(label_sets[name].labels)}")
        calibrations[name] = calibration
    return calibrations


def write_calibration(path: Path, name: str, calibration: Calibration) -> None:
    """Add (or replace) one label set's calibration in the file at `path`, keeping the others."""
    path = Path(path)
    spec = json.loads(path.read_text()) if path.is_file() else {}
    spec[name] = calibration.to_json()
    path.write_text(json.dumps(spec, indent=2) + "\n")
