"""Per-row sampling metadata: the logprobs mode enum and the validated SamplingParams record."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real


class LogprobsMode(str, enum.Enum):
    """Which [V] vector a row's logprobs / candidates / top list are read from."""

    RAW_LOGPROBS = "raw_logprobs"  # float32 log_softmax of model logits, before any processing
    RAW_LOGITS = "raw_logits"  # float32 copy of model logits
    PROCESSED_LOGPROBS = "processed_logprobs"  # log_softmax after the processors (filtered = -inf)
    PROCESSED_LOGITS = "processed_logits"  # logits after the processors (filtered = -inf)

    @property
    def is_processed(self) -> bool:
        return self in (LogprobsMode.PROCESSED_LOGPROBS, LogprobsMode.PROCESSED_LOGITS)

    @property
    def is_logprobs(self) -> bool:
        return self in (LogprobsMode.RAW_LOGPROBS, LogprobsMode.PROCESSED_LOGPROBS)


def _is_int(v: object) -> bool:
    # bool is an Integral too, but True as a token id / top_k is always a caller bug
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _finite_float(name: str, v: object) -> float:
    if not _is_real(v) or not math.isfinite(float(v)):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class SamplingParams:
    """Options of one batch row. Off values: None everywhere, plus top_k 0/-1, top_p 1.0, min_p 0.0.

    temperature 0.0 means greedy when sampling and "processor off" for logprobs.
    """

    logprobs_mode: LogprobsMode = LogprobsMode.RAW_LOGPROBS
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    label_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        # frozen: normalise through object.__setattr__ so equal options compare / hash equal
        set_ = object.__setattr__
        try:
            set_(self, "logprobs_mode", LogprobsMode(self.logprobs_mode))
        except ValueError:
            raise ValueError(f"unknown logprobs_mode {self.logprobs_mode!r}") from None

        if self.temperature is not None:
            t = _finite_float("temperature", self.temperature)
            if t < 0.0:
                raise ValueError(f"temperature must be >= 0, got {t}")
            set_(self, "temperature", t)

        if self.top_k is not None:
            if not _is_int(self.top_k) or self.top_k < -1:
                raise ValueError(f"top_k must be an int >= -1 (0 and -1 mean off), got {self.top_k!r}")
            set_(self, "top_k", int(self.top_k))

        if self.top_p is not None:
            p = _finite_float("top_p", self.top_p)
            if not 0.0 < p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {p}")
            set_(self, "top_p", p)

        if self.min_p is not None:
            m = _finite_float("min_p", self.min_p)
            if not 0.0 <= m <= 1.0:
                raise ValueError(f"min_p must be in [0, 1], got {m}")
            set_(self, "min_p", m)

        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        pairs: list[tuple[int, float]] = []
        try:
            for tok, b in bias:
                if not _is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias token id must be an int >= 0, got {tok!r}")
                pairs.append((int(tok), _finite_float("logit_bias value", b)))
        except TypeError:
            raise ValueError("logit_bias must be (token_id, bias) pairs") from None
        if len({tok for tok, _ in pairs}) != len(pairs):
            # a dict cannot say this; with pairs, "add twice" vs "last wins" would be a guess
            raise ValueError("logit_bias has a duplicate token id")
        set_(self, "logit_bias", tuple(pairs))

        if isinstance(self.label_token_ids, (str, bytes)):
            raise ValueError("label_token_ids must be a sequence of ints")
        try:
            labels = tuple(self.label_token_ids)
        except TypeError:
            raise ValueError("label_token_ids must be a sequence of ints") from None
        for tok in labels:
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"label token id must be an int >= 0, got {tok!r}")
        set_(self, "label_token_ids", tuple(int(t) for t in labels))

        if not _is_int(self.top_logprobs) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {self.top_logprobs!r}")
        set_(self, "top_logprobs", int(self.top_logprobs))

    # --- which processors are on (the single definition of "off" used by the processors) ---

    @property
    def temperature_on(self) -> bool:
        # 1.0 is an exact identity, so skipping it only saves work
        return self.temperature is not None and self.temperature > 0.0 and self.temperature != 1.0

    @property
    def min_p_on(self) -> bool:
        return self.min_p is not None and self.min_p > 0.0

    @property
    def top_k_on(self) -> bool:
        return self.top_k is not None and self.top_k > 0

    @property
    def top_p_on(self) -> bool:
        return self.top_p is not None and self.top_p < 1.0

    @property
    def needs_processing(self) -> bool:
        """True when any processor would change this row's logits."""
        return bool(self.logit_bias) or self.temperature_on or self.min_p_on or self.top_k_on or self.top_p_on

    @property
    def is_greedy(self) -> bool:
        """Sampling picks the argmax when temperature is unset or 0."""
        return self.temperature is None or self.temperature == 0.0
