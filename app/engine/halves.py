"""Retry in halves: the pieces a failing group of units is tried in, until each unit that fails stands alone, so
only its caller gets the error (the scoring batcher, a prefill and a decode step alike)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, NamedTuple, TypeVar

P = TypeVar("P")  # a piece of the group: a list of units, or units with their state (rows and their cache)
U = TypeVar("U")


def slice_units(units: Sequence[U], start: int, stop: int) -> Sequence[U]:
    return units[start:stop]


class Halves(Generic[P]):
    """Iterate the pieces to attempt, the whole group first, and report each failure with `failed`. A failed piece
    of several units is split and its halves come next (left first, depth first, so units keep their order); a unit
    that fails alone goes to `fail_alone(piece, exc)`. Sync and async callers drive it the same way:

        for piece in (halves := Halves(group, fail_alone, log, "decode step", "row")):
            try:
                attempt(piece)
            except Exception as exc:
                halves.failed(piece, exc)

    `take(piece, start, stop)` cuts units [start, stop) out of a piece (with their state: a decode batch's rows); a
    half is cut only when its turn comes, so the right half holds no memory while the left one runs."""

    def __init__(self, whole: P, fail_alone: Callable[[P, Exception], None], log: logging.Logger, what: str,
                 unit: str, size: Callable[[P], int] = len, take: Callable[[P, int, int], P] = slice_units):
        self._pending: list[P | _Cut] = [whole]  # a stack, the next piece last
        self._fail_alone = fail_alone
        self._log = log
        self._what = what  # for the log: what failed ("decode step") and of what ("row")
        self._unit = unit
        self._size = size
        self._take = take

    def __iter__(self) -> Iterator[P]:
        while self._pending:
            entry = self._pending.pop()
            yield self._take(*entry) if isinstance(entry, _Cut) else entry

    def failed(self, piece: P, exc: Exception) -> None:
        units = self._size(piece)
        if units > 1:
            # Type only: the message of a model error can quote the input, and request content stays out of logs.
            self._log.warning("%s of %d %ss failed (%s); retrying them in halves", self._what, units, self._unit,
                              type(exc).__name__)
            half = units // 2
            self._pending += [_Cut(piece, half, units), _Cut(piece, 0, half)]
            return
        self._log.error("%s failed on its own for one %s; its caller gets the error", self._what, self._unit,
                        exc_info=exc)
        self._fail_alone(piece, exc)


class _Cut(NamedTuple):
    """Units [start, stop) of a piece that failed, cut when their turn comes."""

    piece: object
    start: int
    stop: int
