"""What the engine runs next: a scoring batch, a generation step, a trim of freed memory, or nothing until woken.

The scheduler holds every rule of the choice and the state they need; the batcher and the generator are passive
parts that say what they hold and do what they are told (app/engine/core.py runs the choice)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from app.engine.batcher import Batcher
from app.engine.generation import Generator

TRIM_INTERVAL_S = 1.0  # giving freed heap back has a cost (docs/users/memory.md); once a second is plenty


@dataclass(frozen=True)
class ScoringBatch:
    """Collect one scoring batch of at most `max_tokens` padded tokens and run it. With `must_fit`, a first unit
    over `max_tokens` stays first in line and nothing runs (a decode cache holds the rest of the budget)."""

    max_tokens: int
    must_fit: bool


@dataclass(frozen=True)
class GenerationStep:
    """Prefill the prompts admitted now and decode one token for every running row. Without `admit_new`, no new
    rows join the running ones (a scoring unit waits for the room they would take)."""

    admit_new: bool


@dataclass(frozen=True)
class Trim:
    """Idle after work: give the pages the last peak left free back to the OS."""


@dataclass(frozen=True)
class Idle:
    """Nothing to run: wait for work, or until `timeout_s` (None: no limit) when a trim is due later."""

    timeout_s: float | None


Action = ScoringBatch | GenerationStep | Trim | Idle


class Scheduler:
    """Scoring batches and generation steps in turn, so neither waits more than one of the other's steps; beside a
    decode cache, a scoring unit must fit the memory left, and while one waits for room no new rows join."""

    def __init__(self, batcher: Batcher, generator: Generator, scoring_allowance: Callable[[], int],
                 budgeted: Callable[[], bool], clock: Callable[[], float] = time.monotonic):
        self._batcher = batcher
        self._generator = generator
        self._scoring_allowance = scoring_allowance  # padded tokens a scoring batch may hold beside the decode cache
        self._budgeted = budgeted  # whether a memory budget is set (only token limits apply until warm)
        self._clock = clock
        self.scoring_held = False  # the first scoring unit in line waits for the room a decode cache holds
        self._scored_last = False  # the last batch or step run was a scoring batch
        self._trim_due = False  # work ran since freed memory was last given back to the OS
        self._trimmed_at = float("-inf")

    def next(self) -> Action:
        """The action to run now."""
        scoring, generating = self._batcher.has_work, self._generator.has_work
        if not (scoring or generating):
            return self._when_idle()
        self._trim_due = True
        if scoring and not (generating and self._scored_last):
            self._scored_last = True
            # With no decode cache the first unit always runs: it was checked against the whole budget at submit.
            decoding = self._budgeted() and self._generator.running > 0
            return ScoringBatch(self._scoring_allowance(), must_fit=decoding)
        self._scored_last = False
        return GenerationStep(admit_new=not self.scoring_held)

    def scored(self, held: bool) -> None:
        """What the scoring batch of the last action did: `held` when its first unit stayed in line for room."""
        self.scoring_held = held

    def _when_idle(self) -> Trim | Idle:
        if not self._trim_due:
            return Idle(None)
        # at most one trim a second under a steady stream of short idle gaps
        too_soon = self._trimmed_at + TRIM_INTERVAL_S - self._clock()
        if too_soon > 0:
            return Idle(too_soon)
        self._trim_due = False
        self._trimmed_at = self._clock()
        return Trim()
