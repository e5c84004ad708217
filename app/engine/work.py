"""Typed work the engine accepts: a scoring query, the unit the batcher schedules, and how to continue a prompt."""

from __future__ import annotations

from dataclasses import dataclass

from sampler import LogprobsMode, SamplingParams


@dataclass(frozen=True)
class ScoreQuery:
    """One scoring request, as the engine sees it: prompts to build and what to read at their ends.

    Texts are tokenized by the engine (on its tokenizer thread); token ids are checked against the vocabulary. Each
    item is appended to the query (put before it with `item_first`); items never get special tokens unless
    `item_special_tokens` (a prompt given whole as an item, as SGLang's text queries are).
    """

    query: str | list[int]
    items: list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    candidates: list[str] | list[list[int]] | None = None
    item_first: bool = False
    add_special_tokens: bool = True
    item_special_tokens: bool = False
    truncate_prompt_tokens: int | None = None
    logprobs_mode: LogprobsMode | str | None = None
    top_logprobs: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    model: str | None = None


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
