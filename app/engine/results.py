"""Typed results the engine gives back: scored prompts, and the events of a generation stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import sampler
from sampler import SamplingParams


class ScoreOutcome(NamedTuple):
    """The result of one ScoreWork."""

    labels: sampler.RowScores | None  # label values, ranks and top list at the next position (label requests)
    candidate_values: list[list[float]] | None  # [C][tokens of candidate c]: each token's value under the mode
    reused_tokens: int  # prompt tokens whose key/value states came from a shared prefix instead of being computed


@dataclass(frozen=True)
class ScoredPrompts:
    """A scored query: its prompts and candidates as token ids, the options they were read under, one outcome each."""

    prompts: list[list[int]]
    candidates: tuple[tuple[int, ...], ...]
    params: SamplingParams
    outcomes: list[ScoreOutcome]

    @property
    def prompt_tokens(self) -> int:
        """Every prompt token once, plus every candidate token once per prompt it follows."""
        return sum(len(p) for p in self.prompts) + len(self.prompts) * sum(len(c) for c in self.candidates)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose key/value states were reused, not recomputed."""
        return sum(o.reused_tokens for o in self.outcomes)


@dataclass
class PositionLogprobs:
    """The numbers at one position, all read from one snapshot under the request's logprobs mode."""

    token_id: int  # the token at this position (prompt token or the one sampled)
    value: float
    top: list[tuple[int, float]]  # (token id, value), best first
    requested: list[float]  # values of logprob_token_ids, in their order


@dataclass
class PromptLogprobs:
    """First event of a request with prompt_logprobs: entry i is prompt token i's logprobs (entry 0 is None)."""

    positions: list[PositionLogprobs | None]


@dataclass
class ChoiceUpdate:
    """What one decode step added to one choice: the token, the text that became final, maybe the end."""

    choice: int
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
