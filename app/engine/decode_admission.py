"""The decode loop's state per prompt and choice, and which waiting choices join the batch at the next step: first
come first served, within the batch's rows, each prompt's share of them, the prefill's tokens, the cache's slots and
the memory budget."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from app.engine.admission import most_that_fit
from app.engine.detokenize import IncrementalDetokenizer
from app.engine.work import GenerationParams


@dataclass(eq=False)
class PromptGroup:
    """One prompt and its n choices."""

    prompt_ids: list[int]
    params: GenerationParams
    queue: asyncio.Queue
    cancelled: bool = False
    unfinished: int = 0
    started: int = 0  # choices admitted so far; the prompt waits until all n have been


class Admission(NamedTuple):
    """Choices first .. first + count - 1 of a prompt, admitted in one step (a prompt's n choices can be admitted
    over several steps, as rows and memory free up)."""

    group: PromptGroup
    first: int
    count: int


@dataclass(eq=False)
class Choice:
    """One choice decoding: its tokens, the text handed out so far, its own random stream."""

    group: PromptGroup
    index: int
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    next_token: int = -1  # sampled, not yet fed to the model
    text: str = ""  # decoded output, stop string cut off
    sent: int = 0  # characters of `text` already handed out
    detokenizer: IncrementalDetokenizer | None = None  # output_ids -> text, a few tokens a step


@dataclass(frozen=True)
class RowLimits:
    """What bounds the decode batch; `fits_memory(rows, final, prefill_rows, prefill_width)` is the memory budget's
    word on rows x final with a prefill of prefill_rows x prefill_width beside them."""

    max_batch_size: int
    max_rows_per_request: int
    max_batch_tokens: int
    max_cache_tokens: int
    fits_memory: Callable[[int, int, int, int], bool]

    def fit(self, rows: int, final: int, prefill_rows: int, longest: int) -> bool:
        return (longest * prefill_rows <= self.max_batch_tokens and rows * final <= self.max_cache_tokens
                and self.fits_memory(rows, final, prefill_rows, longest))

    def most_rows(self, rows: int, wanted: int, final: int, prefill_rows: int, longest: int) -> int:
        """The most of `wanted` new rows (0 when none) that fit beside `rows`, by bisection (fit is monotone)."""
        return most_that_fit(0, max(0, wanted), lambda new: self.fit(rows + new, final, prefill_rows, longest))


def plan_admissions(waiting: list[PromptGroup], running: list[PromptGroup],
                    final_length: Callable[[PromptGroup], int], limits: RowLimits) -> list[Admission]:
    """Choices of `waiting` prompts (in arrival order) that join rows decoding for `running` (one entry per row).

    A prompt's choices are admitted as far as they fit; the rest wait for rows to free up. With nothing running, one
    choice of the first prompt is always taken, so a big request is never stuck. The cache is rows x the batch's
    width, and the width grows by one every step, so choices are admitted only if every row could reach its final
    length within the limits: they hold at every step, not only now. Advances each admitted prompt's `started`.
    """
    admitted: list[Admission] = []
    rows = len(running)
    held = Counter(running)  # rows each prompt holds now
    final = max((final_length(g) for g in running), default=0)
    longest = 0
    for group in waiting:
        new_longest = max(longest, len(group.prompt_ids))
        new_final = max(final, final_length(group))
        prefill_rows = len(admitted) + 1
        remaining = group.params.n - group.started
        forced = not admitted and not running
        if group.params.max_tokens == 0:  # answered by the prefill alone: no decode rows
            if not forced and not limits.fit(rows, final, prefill_rows, new_longest):
                break
            count = remaining
        else:
            wanted = min(remaining, limits.max_rows_per_request - held[group], limits.max_batch_size - rows)
            if wanted <= 0:
                if held[group]:
                    continue  # at its share of rows: the prompts behind it may take the others
                break  # the batch is full
            count = limits.most_rows(rows, wanted, new_final, prefill_rows, new_longest)
            if count == 0:
                if not forced:
                    break  # first come, first served: nobody overtakes the head of the queue
                count = 1
        admitted.append(Admission(group, group.started, count))
        group.started += count
        if group.params.max_tokens:
            rows += count
            held[group] += count
            final = new_final
        longest = new_longest
    return admitted
