"""Typed work the engine accepts: a scoring query, the unit the batcher schedules, and how to continue a prompt."""

from __future__ import annotations

from dataclasses import dataclass

from sampler import SamplingParams


@dataclass(frozen=True)
class ScoreQuery:
    """One scoring request as the engine takes it from every route: prompts as token ids and what to read at their
    ends. The API layer renders, tokenizes (on its one tokenizer thread) and checks the inputs first.

    `candidates` are scored as continuations of each prompt (none: the next position's labels). `param` names the
    request field the prompts came from ("query" for a lone query, else e.g. "items" or "documents": prompt i is
    `items[i]`), for an error about one prompt."""

    prompts: list[list[int]]
    params: SamplingParams
    candidates: tuple[tuple[int, ...], ...] = ()
    param: str = "items"

    def prompt_param(self, i: int) -> str:
        return prompt_param(self.param, i)


def prompt_param(param: str, i: int) -> str:
    """The request field that names prompt i: the query itself when it stands alone, else `param[i]`."""
    return param if param == "query" else f"{param}[{i}]"


@dataclass(frozen=True)
class ScoreWork:
    """One prompt to score: the batcher's unit of work.

    `shared_prefix_len` leading tokens are common to every prompt of its request (the query,
    when items follow it): units carrying the same prefix in a batch run it once. With
    `candidates`, each candidate is scored as a continuation of the prompt.
    """

    token_ids: list[int]
    params: SamplingParams
    shared_prefix_len: int = 0
    candidates: tuple[tuple[int, ...], ...] = ()

    @property
    def cost(self) -> int:
        """Tokens this unit puts through the model if nothing is shared: one row per candidate, or one row."""
        longest_candidate = max((len(c) for c in self.candidates), default=0)
        return max(1, len(self.candidates)) * (len(self.token_ids) + longest_candidate)


@dataclass(frozen=True)
class GenerationParams:
    """How to continue one prompt. `sampling` holds the processors and the logprobs mode."""

    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    n: int = 1
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # top-N at each generated position; None = no logprobs for generated tokens
    prompt_logprobs: bool = False  # the logprob of every prompt token after the first (echo with logprobs)
    logprob_token_ids: tuple[int, ...] = ()  # also report these ids' values at every reported position

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
