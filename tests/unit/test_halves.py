"""Retry in halves, on its own: the order pieces are tried in, who is failed alone, and halves cut only when due."""

from __future__ import annotations

import logging

from app.engine.halves import Halves

log = logging.getLogger("genscore.test")


def _drive(units, bad, **cut):
    tried, alone, done = [], [], []
    halves = Halves(units, lambda piece, exc: alone.append((list(piece), str(exc))), log, "batch", "unit", **cut)
    for piece in halves:
        tried.append(list(piece))
        try:
            if bad & set(piece):
                raise RuntimeError(f"bad {sorted(bad & set(piece))}")
        except RuntimeError as exc:
            halves.failed(piece, exc)
            continue
        done.extend(piece)
    return tried, alone, done


def test_only_the_units_that_fail_alone_fail_and_the_rest_run_in_order():
    tried, alone, done = _drive(list(range(8)), {2, 5})
    assert tried == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3], [0, 1], [2, 3], [2], [3], [4, 5, 6, 7], [4, 5], [4],
                     [5], [6, 7]]
    assert alone == [([2], "bad [2]"), ([5], "bad [5]")]
    assert done == [0, 1, 3, 4, 6, 7]


def test_a_group_that_succeeds_is_tried_once_and_a_lone_failure_is_failed_at_once():
    assert _drive([1, 2, 3], set()) == ([[1, 2, 3]], [], [1, 2, 3])
    assert _drive([7], {7}) == ([[7]], [([7], "bad [7]")], [])


def test_a_half_is_cut_only_when_its_turn_comes():
    cuts = []

    def take(units, start, stop):
        cuts.append((start, stop))
        return units[start:stop]

    halves = Halves(list(range(4)), lambda piece, exc: None, log, "batch", "unit", take=take)
    pieces = iter(halves)
    whole = next(pieces)
    halves.failed(whole, RuntimeError())
    assert cuts == []  # nothing cut yet: the right half would hold memory while the left one runs
    assert next(pieces) == [0, 1] and cuts == [(0, 2)]
    assert next(pieces) == [2, 3] and cuts == [(0, 2), (2, 4)]
