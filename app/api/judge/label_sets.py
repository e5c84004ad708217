"""Label sets: named labels, each with one or more surface forms (text or token ids), read from a request or from the
server's label-sets file, and bound to the served tokenizer as the candidates the engine scores."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from app.errors import InvalidRequestError

Form = str | list[int]  # a surface form: text (tokenized alone, without special tokens) or token ids


class LabelSetError(ValueError):
    """A label set that cannot be used: empty, a label without forms, a form of the wrong type."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class LabelSet:
    """Labels in their order, each with its surface forms as given."""

    name: str | None  # the name in the server's label-sets file; None for a set sent inline
    labels: tuple[str, ...]
    forms: tuple[tuple[Form, ...], ...]  # forms[i]: label i's surface forms

    @property
    def values(self) -> tuple[float, ...] | None:
        """Each label as a number when every label name is one (a rating scale), else None."""
        try:
            numbers = tuple(float(label) for label in self.labels)
        except ValueError:
            return None
        return numbers if all(n == n and abs(n) != float("inf") for n in numbers) else None


def parse_label_set(spec: object, name: str | None, param: str) -> LabelSet:
    """{"label": [form, ...], ...} -> a LabelSet; LabelSetError naming the field (under `param`) when malformed."""
    if not isinstance(spec, Mapping) or not spec:
        raise LabelSetError("a label set is an object of at least one label, each with a list of surface forms", param)
    labels, forms = [], []
    for label, label_forms in spec.items():
        where = f"{param}.{label}"
        if not label.strip():
            raise LabelSetError("a label name must not be empty", where)
        if not isinstance(label_forms, list) or not label_forms:
            raise LabelSetError(f"label {label!r} needs a list of at least one surface form", where)
        for i, form in enumerate(label_forms):
            is_ids = isinstance(form, list) and all(type(t) is int for t in form)
            if not (isinstance(form, str) or is_ids):
                raise LabelSetError("a surface form is a string or a list of token ids", f"{where}[{i}]")
        labels.append(label)
        forms.append(tuple(f if isinstance(f, str) else list(f) for f in label_forms))
    if len(labels) < 2:
        raise LabelSetError("a label set needs at least two labels to compare", param)
    return LabelSet(name, tuple(labels), tuple(forms))


def read_label_sets(path: Path) -> dict[str, LabelSet]:
    """The server's label-sets file: {"set name": {"label": [form, ...], ...}, ...}; ValueError when unusable."""
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the label-sets file {path}: {exc}") from None
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"label-sets file {path} must be a JSON object of named label sets")
    sets = {}
    for name, body in spec.items():
        try:
            sets[name] = parse_label_set(body, name, name)
        except LabelSetError as exc:
            raise ValueError(f"label-sets file {path}, {exc.param}: {exc}") from None
    return sets


def resolve_label_set(spec: str | Mapping, known: Mapping[str, LabelSet], param: str = "labels") -> LabelSet:
    """A request's `labels`: the name of a set in the server's file, or a set written inline."""
    if isinstance(spec, str):
        if spec not in known:
            names = ", ".join(sorted(known)) or "none (the server has no --label-sets file)"
            raise InvalidRequestError(f"unknown label set {spec!r}; this server defines: {names}", param)
        return known[spec]
    try:
        return parse_label_set(spec, None, param)
    except LabelSetError as exc:
        raise InvalidRequestError(str(exc), exc.param) from None


@dataclass(frozen=True)
class BoundLabelSet:
    """A label set on the served tokenizer: every form as token ids, flattened in label order, and whose it is."""

    label_set: LabelSet
    candidates: tuple[tuple[int, ...], ...]  # every surface form's token ids, label after label
    owner: tuple[int, ...]  # owner[k]: the label of candidates[k]


def bind_label_set(label_set: LabelSet, tokenizer, vocab_size: int, max_forms: int,
                   param: str = "labels") -> BoundLabelSet:
    """Tokenize each text form alone (no special tokens, as `candidates` are); 400 naming the form when it gives no
    token, holds an id outside the vocabulary, or repeats or extends another form's tokens.

    The forms must be prefix-free: the probability of " Yes, it is" is part of the probability of " Yes", so a set
    holding both would count that mass twice and its sum would be no probability."""
    total = sum(len(f) for f in label_set.forms)
    if total > max_forms:
        raise InvalidRequestError(f"the label set has {total} surface forms, more than the limit of {max_forms} "
                                  "(--max-candidates)", param)
    candidates: list[tuple[int, ...]] = []
    owner: list[int] = []
    seen: dict[tuple[int, ...], str] = {}
    for i, (label, forms) in enumerate(zip(label_set.labels, label_set.forms)):
        for j, form in enumerate(forms):
            where = f"{param}.{label}[{j}]"
            ids = tuple(tokenizer(form, add_special_tokens=False)["input_ids"]) if isinstance(form, str) else tuple(form)
            if not ids:
                raise InvalidRequestError(f"the surface form {form!r} of label {label!r} tokenizes to nothing", where)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", where)
            if ids in seen:
                raise InvalidRequestError(f"the surface form {form!r} gives the same tokens {list(ids)} as "
                                          f"{seen[ids]}; each form may appear once", where)
            seen[ids] = where
            candidates.append(ids)
            owner.append(i)
    _check_prefix_free(candidates, list(seen.values()))
    return BoundLabelSet(label_set, tuple(candidates), tuple(owner))


def _check_prefix_free(candidates: list[tuple[int, ...]], names: list[str]) -> None:
    """400 naming the longer of two forms when one's tokens begin with the other's."""
    index = {ids: k for k, ids in enumerate(candidates)}
    for k, ids in enumerate(candidates):
        for end in range(1, len(ids)):
            shorter = index.get(ids[:end])
            if shorter is not None:
                raise InvalidRequestError(
                    f"the tokens of this surface form begin with those of {names[shorter]}, whose probability "
                    "already includes it; the forms of a label set must not extend one another", names[k])
