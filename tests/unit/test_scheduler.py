"""The scheduler's choice of what runs next, on stand-in parts: turns between scoring and generation, room for a
scoring unit beside a decode cache, and trims when idle. No model, no event loop."""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.scheduler import TRIM_INTERVAL_S, GenerationStep, Idle, Scheduler, ScoringBatch, Trim


@dataclass
class Parts:
    """What the scheduler reads of the batcher and the generator, set by each test."""

    has_work: bool = False
    running: int = 0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler(scoring: Parts, generation: Parts, budgeted: bool = True, clock=None) -> Scheduler:
    return Scheduler(scoring, generation, scoring_allowance=lambda: 500, budgeted=lambda: budgeted,
                     clock=clock or Clock())


def test_scoring_and_generation_take_turns():
    scoring, generation = Parts(has_work=True), Parts(has_work=True, running=2)
    s = scheduler(scoring, generation)
    kinds = [type(s.next()) for _ in range(4)]
    assert kinds == [ScoringBatch, GenerationStep, ScoringBatch, GenerationStep]
    scoring.has_work = False
    assert [type(s.next()) for _ in range(2)] == [GenerationStep, GenerationStep]
    generation.has_work, scoring.has_work = False, True
    assert [type(s.next()) for _ in range(2)] == [ScoringBatch, ScoringBatch]


def test_a_scoring_batch_must_fit_only_beside_a_decode_cache_under_a_budget():
    scoring = Parts(has_work=True)
    assert scheduler(scoring, Parts()).next() == ScoringBatch(500, must_fit=False)
    assert scheduler(scoring, Parts(has_work=True, running=1)).next() == ScoringBatch(500, must_fit=True)
    assert scheduler(scoring, Parts(has_work=True, running=1), budgeted=False).next() == ScoringBatch(500, False)


def test_no_new_rows_join_while_a_scoring_unit_waits_for_room():
    scoring, generation = Parts(has_work=True), Parts(has_work=True, running=1)
    s = scheduler(scoring, generation)
    assert isinstance(s.next(), ScoringBatch)
    s.scored(held=True)
    assert s.next() == GenerationStep(admit_new=False)
    assert isinstance(s.next(), ScoringBatch)
    s.scored(held=False)  # it ran: rows may join again
    assert s.next() == GenerationStep(admit_new=True)


def test_idle_after_work_trims_at_most_once_a_second():
    clock = Clock()
    scoring = Parts()
    s = scheduler(scoring, Parts(), clock=clock)
    assert s.next() == Idle(None)  # nothing ran yet: nothing to give back
    scoring.has_work = True
    s.next()
    scoring.has_work = False
    assert s.next() == Trim()
    assert s.next() == Idle(None)
    scoring.has_work = True
    s.next()
    scoring.has_work = False
    clock.now += 0.25
    assert s.next() == Idle(TRIM_INTERVAL_S - 0.25)  # the last trim was a quarter second ago
    clock.now += TRIM_INTERVAL_S
    assert s.next() == Trim()
