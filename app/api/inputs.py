"""Input checks, each written once: every route's token ids, counts, lengths and processor options go through here."""

from __future__ import annotations

import math
from collections.abc import Sequence

from app.errors import InvalidRequestError, ModelNotServedError
from app.settings import Settings
from sampler import LogprobsMode, SamplingParams


def check_list_size(values: Sequence, limit: int, param: str, noun: str) -> None:
    """A list field that is given must hold between 1 and `limit` entries; else a 400 naming `param`."""
    if not values:
        raise InvalidRequestError(f"{param} must hold at least one {noun} when given", param)
    if len(values) > limit:
        raise InvalidRequestError(f"{len(values)} {param} exceed the limit of {limit}", param)


def check_limit(value: int | None, limit: int, param: str, setting: str) -> None:
    """400 naming the field, the limit and its setting when a request asks for more than the server allows.

    For the per-request counts the routes check (e.g. `max_tokens` against `max_generated_tokens`)."""
    if value is not None and value > limit:
        raise InvalidRequestError(f"{param} = {value} exceeds the server limit of {limit} ({setting})", param)


class InputChecks:
    """The checks that depend on the served model and the server's caps."""

    def __init__(self, model_name: str, vocab_size: int, max_length: int, settings: Settings):
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_length = max_length  # the model's context: prompt + generated tokens
        self.max_prompt_tokens = min(settings.max_prompt_tokens or max_length, max_length)
        self.settings = settings

    def model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotServedError(f"model {name!r} is not served here; this server serves {self.model_name!r}",
                                      param="model", code="model_not_found")

    def token_ids(self, ids: Sequence[int], param: str) -> None:
        for i, token_id in enumerate(ids):
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"{param}[{i}] = {token_id} is outside the vocabulary [0, {self.vocab_size})", param)

    def label_ids(self, ids: Sequence[int], param: str) -> None:
        """Token ids to report at a position: under max_label_token_ids, each in the vocabulary."""
        if len(ids) > self.settings.max_label_token_ids:
            raise InvalidRequestError(
                f"{len(ids)} {param} exceed the limit of {self.settings.max_label_token_ids}", param)
        self.token_ids(ids, param)

    def top_logprobs(self, value: int, param: str) -> None:
        if value > self.settings.max_top_logprobs:
            raise InvalidRequestError(
                f"{param} = {value} exceeds the server cap of {self.settings.max_top_logprobs}", param)

    def prompt(self, ids: Sequence[int], param: str, hint: str = "") -> None:
        """A prompt must have a token and fit max_prompt_tokens; `hint` says how the caller can shorten it."""
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens to condition on)", param)
        if len(ids) > self.max_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, more than the maximum of {self.max_prompt_tokens}{hint}", param)

    def logit_bias(self, logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI-style {"<token id>": bias} -> (id, bias) pairs, each id checked against this model's vocabulary."""
        pairs: list[tuple[int, float]] = []
        for key, value in (logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token id {token_id} is outside the vocabulary [0, {self.vocab_size})", "logit_bias")
            if not math.isfinite(value):
                raise InvalidRequestError("logit_bias values must be finite", "logit_bias")
            pairs.append((token_id, value))
        return tuple(pairs)

    def sampling(self, logprobs_mode: LogprobsMode | str | None, logit_bias: dict[str, float] | None,
                 **options) -> SamplingParams:
        """SamplingParams under the request's mode (default: the server's), its bias checked; the sampler's own
        refusals become a 400."""
        try:
            return SamplingParams(logprobs_mode=logprobs_mode or self.settings.default_logprobs_mode,
                                  logit_bias=self.logit_bias(logit_bias), **options)
        except ValueError as exc:  # the schemas already bound these; this is the sampler's own word
            raise InvalidRequestError(str(exc)) from None
