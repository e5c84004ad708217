"""The dynamic batcher: coalescing, limits, per-caller results, admission, deadlines, failures and cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from app.deadline import request_deadline
from app.engine.batcher import Batcher
from app.errors import DeadlineExceededError, EngineError, OverloadedError, ServiceUnavailableError
from tests.gates import async_wait_until


class Recorder:
    """A handler that records each batch it gets and answers each unit with a function of it; with a gate, each
    batch sets `entered` and waits for the gate (the test's way to hold the worker, never a sleep)."""

    def __init__(self, answer=lambda w: ("done", w), fail_when=lambda batch: False, gate: threading.Event | None = None):
        self.batches: list[list] = []
        self.answer = answer
        self.fail_when = fail_when
        self.gate = gate
        self.entered = threading.Event()

    def __call__(self, batch):
        self.entered.set()
        if self.gate is not None and not self.gate.wait(60):
            raise AssertionError("the test never opened the gate")
        self.batches.append(list(batch))
        if self.fail_when(batch):
            raise RuntimeError("boom")
        return [self.answer(w) for w in batch]


async def running(handler: Recorder) -> None:
    """Until the worker has taken a batch (and, with a gate, is held in it)."""
    await async_wait_until(handler.entered.is_set, what="a batch to reach the handler")


async def queued(batcher: Batcher, units: int) -> None:
    await async_wait_until(lambda: batcher.waiting == units, what=f"{units} queued units")


class FakeClock:
    """time.monotonic for the batcher and admission, moved by the test: deadlines pass when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = staticmethod(time.perf_counter)


class Driver:
    """Plays the engine's part for a batcher alone (app/engine/core.py, Engine.step): collect a batch and run it
    whenever units are queued; if this loop ends, every caller hears it, as the engine's callers do."""

    def __init__(self, batcher: Batcher):
        self._batcher = batcher
        self._wake = asyncio.Event()
        batcher.on_work = self._wake.set
        self.task = asyncio.get_running_loop().create_task(self._loop())
        self.task.add_done_callback(lambda _: batcher.fail_all(ServiceUnavailableError("the batcher stopped")))

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            if not self._batcher.has_work:
                await self._wake.wait()
                continue
            await self._batcher.run(await self._batcher.collect())

    @property
    def alive(self) -> bool:
        return not self.task.done()

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def make(handler, **limits):
    options = dict(max_batch_size=8, max_batch_tokens=10_000, max_wait_ms=20)
    options.update(limits)
    return Batcher(handler, tokens_of=lambda w: w[1], executor=ThreadPoolExecutor(1), **options)


async def test_concurrent_callers_share_a_batch_and_get_their_own_results():
    handler = Recorder()
    batcher = make(handler)
    driver = Driver(batcher)
    works = [[(f"a{i}", 3) for i in range(3)], [("b0", 5)], [(f"c{i}", 2) for i in range(2)]]
    results = await asyncio.gather(*(batcher.submit(w) for w in works))
    for submitted, got in zip(works, results):
        assert got == [("done", w) for w in submitted]
    assert len(handler.batches) == 1 and len(handler.batches[0]) == 6
    await driver.stop()


async def test_a_lone_caller_is_not_kept_waiting_for_company():
    handler = Recorder()
    batcher = make(handler, max_wait_ms=3_600_000)  # an hour: a batch that waited out max wait would time out here
    driver = Driver(batcher)
    for i in range(3):  # one caller, one request after another: each runs at once
        assert await asyncio.wait_for(batcher.submit([(i, 1)]), 30) == [("done", (i, 1))]
    assert [len(b) for b in handler.batches] == [1, 1, 1]
    await driver.stop()


async def test_after_a_larger_batch_the_next_one_waits_for_as_many_callers():
    handler = Recorder()
    batcher = make(handler, max_wait_ms=3_600_000)
    driver = Driver(batcher)
    await asyncio.wait_for(asyncio.gather(*(batcher.submit([(f"a{i}", 1)]) for i in range(3))), 30)
    first = asyncio.create_task(batcher.submit([("b0", 1)]))
    await asyncio.sleep(0)  # b0 is queued ...
    await async_wait_until(lambda: batcher.waiting == 0, what="b0 to be taken into a batch")  # ... and taken
    # Three callers were in flight, so the batch b0 opened waits for two more callers rather than running alone.
    later = [batcher.submit([(f"b{i}", 1)]) for i in (1, 2)]
    await asyncio.wait_for(asyncio.gather(first, *later), 30)
    assert [len(b) for b in handler.batches] == [3, 3]
    await driver.stop()


async def test_a_lone_caller_with_fewer_units_than_its_last_request_runs_at_once():
    handler = Recorder()
    batcher = make(handler, max_wait_ms=3_600_000)  # an hour: a batch that waited out max wait would time out here
    driver = Driver(batcher)
    for n in (5, 2, 1):  # one caller whose requests hold fewer and fewer units (items of a query, say)
        work = [(f"r{n}-{i}", 1) for i in range(n)]
        assert await asyncio.wait_for(batcher.submit(work), 30) == [("done", w) for w in work]
    assert [len(b) for b in handler.batches] == [5, 2, 1]
    await driver.stop()


async def test_batch_size_limit():
    handler = Recorder()
    batcher = make(handler, max_batch_size=4)
    driver = Driver(batcher)
    results = await batcher.submit([(i, 1) for i in range(10)])
    assert [r[1][0] for r in results] == list(range(10))
    assert [len(b) for b in handler.batches] == [4, 4, 2]
    await driver.stop()


async def test_token_budget_counts_padding():
    handler = Recorder()
    # budget 20 padded tokens: two of length 10 fit, a third would make 30
    batcher = make(handler, max_batch_tokens=20)
    driver = Driver(batcher)
    await batcher.submit([("x", 10), ("y", 10), ("z", 10), ("long", 50)])
    sizes = [[w[0] for w in b] for b in handler.batches]
    assert sizes == [["x", "y"], ["z"], ["long"]]  # a unit over budget on its own still runs, alone
    for batch in handler.batches:
        assert len(batch) == 1 or max(w[1] for w in batch) * len(batch) <= 20
    await driver.stop()


async def test_failed_batch_is_split_so_only_the_failing_unit_fails():
    gate = threading.Event()
    handler = Recorder(fail_when=lambda batch: any(w[0] == "bad" for w in batch), gate=gate)
    batcher = make(handler)
    driver = Driver(batcher)
    blocker = asyncio.create_task(batcher.submit([("blocker", 1)]))
    await running(handler)  # the worker is held: every caller below queues, then all seven units share a batch
    callers = [[("ok0", 1)], [("ok1", 1), ("ok2", 1)], [("bad", 1)], [("ok3", 1)], [("ok4", 1), ("ok5", 1)]]
    tasks = [asyncio.create_task(batcher.submit(w)) for w in callers]
    await queued(batcher, 7)
    gate.set()
    await blocker
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(outcomes[2], EngineError) and "boom" not in str(outcomes[2])  # the cause goes to the log only
    for works, got in zip(callers, outcomes):
        if works[0][0] != "bad":
            assert got == [("done", w) for w in works]
    # the shared batch failed and was retried in halves, each failing half split again, down to "bad" alone
    assert [[w[0] for w in b] for b in handler.batches][1:] == [
        ["ok0", "ok1", "ok2", "bad", "ok3", "ok4", "ok5"],
        ["ok0", "ok1", "ok2"],
        ["bad", "ok3", "ok4", "ok5"],
        ["bad", "ok3"],
        ["bad"],
        ["ok3"],
        ["ok4", "ok5"],
    ]
    assert await batcher.submit([("after", 1)]) == [("done", ("after", 1))]
    assert driver.alive
    await driver.stop()


@pytest.mark.parametrize("oom", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 RuntimeError("CUDA error: out of memory"), MemoryError()],
                         ids=["torch.OutOfMemoryError", "RuntimeError", "MemoryError"])
async def test_out_of_memory_batch_is_retried_smaller_and_everyone_succeeds(oom):
    capacity = 3  # the "device" holds at most 3 units: bigger batches run out of memory

    def handler(batch):
        if len(batch) > capacity:
            raise oom
        return [("done", w) for w in batch]

    batcher = make(handler, max_batch_size=16)
    driver = Driver(batcher)
    callers = [[(f"r{i}u{j}", 1) for j in range(i % 3 + 1)] for i in range(8)]
    results = await asyncio.gather(*(batcher.submit(w) for w in callers))
    assert results == [[("done", w) for w in works] for works in callers]
    await driver.stop()


async def test_a_request_with_a_failing_unit_fails_whole_and_its_other_units_are_dropped():
    gate = threading.Event()
    handler = Recorder(fail_when=lambda batch: any(w[0] == "bad" for w in batch), gate=gate)
    batcher = make(handler, max_batch_size=1, max_wait_ms=0)
    driver = Driver(batcher)
    request = asyncio.create_task(batcher.submit([("bad", 1), ("sibling", 1)]))
    other = asyncio.create_task(batcher.submit([("other", 1)]))
    await running(handler)  # "bad" holds the worker; "sibling" and "other" wait behind it
    await queued(batcher, 2)
    gate.set()
    with pytest.raises(EngineError):
        await request
    assert await other == [("done", ("other", 1))]
    assert "sibling" not in [w[0] for b in handler.batches for w in b]
    await driver.stop()


async def test_full_admission_queue_refuses_at_once_with_retry_after():
    gate = threading.Event()
    handler = Recorder(gate=gate)
    batcher = make(handler, max_wait_ms=0, max_queued_requests=2, retry_after_s=7)
    driver = Driver(batcher)
    admitted = [asyncio.create_task(batcher.submit([(f"a{i}", 1)])) for i in range(2)]
    await running(handler)
    assert batcher.admitted == 2
    with pytest.raises(OverloadedError) as refused:
        await batcher.submit([("over", 1)])
    assert refused.value.status_code == 503 and refused.value.headers == {"Retry-After": "7"}
    assert "max_queued_requests" in refused.value.message
    assert batcher.admitted == 2
    gate.set()
    assert [await t for t in admitted] == [[("done", ("a0", 1))], [("done", ("a1", 1))]]
    assert batcher.admitted == 0
    assert await batcher.submit([("later", 1)]) == [("done", ("later", 1))]  # room again once answered
    assert "over" not in [w[0] for b in handler.batches for w in b]
    await driver.stop()


async def test_admission_is_released_by_failures_and_cancellations():
    gate = threading.Event()
    handler = Recorder(fail_when=lambda batch: any(w[0] == "bad" for w in batch), gate=gate)
    batcher = make(handler, max_wait_ms=0, max_queued_requests=3)
    driver = Driver(batcher)
    first = asyncio.create_task(batcher.submit([("first", 1)]))
    await running(handler)  # "first" holds the worker: the other two queue behind it
    bad = asyncio.create_task(batcher.submit([("bad", 1)]))
    doomed = asyncio.create_task(batcher.submit([("doomed", 1)]))
    await queued(batcher, 2)
    assert batcher.admitted == 3
    doomed.cancel()
    gate.set()
    await first
    with pytest.raises(EngineError):
        await bad
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert batcher.admitted == 0
    await driver.stop()


async def test_deadline_passing_in_the_queue_is_504_and_the_work_never_runs():
    gate = threading.Event()
    handler = Recorder(gate=gate)
    batcher = make(handler, max_wait_ms=0)
    driver = Driver(batcher)
    blocker = asyncio.create_task(batcher.submit([("blocker", 1)]))
    await running(handler)  # "blocker" holds the worker until the gate opens, long after late's deadline
    with pytest.raises(DeadlineExceededError) as late:
        await batcher.submit([("late", 1)], deadline=time.monotonic() + 0.05)
    assert late.value.status_code == 504
    gate.set()
    await blocker
    assert await batcher.submit([("next", 1)]) == [("done", ("next", 1))]
    assert "late" not in [w[0] for b in handler.batches for w in b]
    await driver.stop()


async def test_deadline_of_the_request_context_is_used_and_started_work_finishes(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("app.engine.batcher.time", clock)
    monkeypatch.setattr("app.engine.admission.time", clock)
    gate = threading.Event()
    handler = Recorder(gate=gate)
    batcher = make(handler, max_wait_ms=0)
    driver = Driver(batcher)

    async def submit_with_context_deadline(works, seconds):
        request_deadline.set(clock.now + seconds)  # as the request guard does per HTTP request
        return await batcher.submit(works)

    started = asyncio.create_task(submit_with_context_deadline([("started", 1)], 30))
    await running(handler)  # "started" is in the handler now, blocked on the gate
    late = asyncio.create_task(submit_with_context_deadline([("queued", 1)], 30))
    await queued(batcher, 1)
    clock.now += 60  # both deadlines have passed
    gate.set()
    assert await started == [("done", ("started", 1))]  # a deadline never aborts work that started
    with pytest.raises(DeadlineExceededError):
        await late
    with pytest.raises(DeadlineExceededError):  # already past: refused before queueing
        await batcher.submit([("x", 1)], deadline=clock.now - 1)
    assert [w[0] for b in handler.batches for w in b] == ["started"]
    await driver.stop()


async def test_cancelled_caller_never_reaches_the_handler():
    gate = threading.Event()
    handler = Recorder(gate=gate)
    batcher = make(handler, max_wait_ms=0)
    driver = Driver(batcher)
    first = asyncio.create_task(batcher.submit([("first", 1)]))
    await running(handler)  # "first" is now running, blocked on the gate
    doomed = asyncio.create_task(batcher.submit([("doomed", 1)]))
    survivor = asyncio.create_task(batcher.submit([("survivor", 1)]))
    await queued(batcher, 2)
    doomed.cancel()
    gate.set()
    assert await first == [("done", ("first", 1))]
    assert await survivor == [("done", ("survivor", 1))]
    with pytest.raises(asyncio.CancelledError):
        await doomed
    seen = [w[0] for b in handler.batches for w in b]
    assert "doomed" not in seen and driver.alive
    await driver.stop()


async def test_fail_all_answers_running_and_queued_callers():
    gate = threading.Event()
    handler = Recorder(gate=gate)
    batcher = make(handler, max_wait_ms=0)
    driver = Driver(batcher)
    in_handler = asyncio.create_task(batcher.submit([("running", 1)]))
    await running(handler)
    waiting = asyncio.create_task(batcher.submit([("queued", 1)]))
    await queued(batcher, 1)
    driver.task.cancel()  # the loop dies (as an unexpected bug would end it) and fails everyone
    await async_wait_until(lambda: not driver.alive, what="the loop to end")
    gate.set()
    for task in (in_handler, waiting):
        with pytest.raises(ServiceUnavailableError):
            await asyncio.wait_for(task, 2)
    assert batcher.waiting == 0 and batcher.running == 0


async def test_wrong_result_count_is_an_error_not_a_hang():
    batcher = Batcher(lambda batch: [], tokens_of=lambda w: 1, executor=ThreadPoolExecutor(1),
                      max_batch_size=4, max_batch_tokens=100, max_wait_ms=1)
    driver = Driver(batcher)
    with pytest.raises(EngineError):
        await asyncio.wait_for(batcher.submit([("a", 1)]), 2)
    await driver.stop()


async def test_a_failing_on_batch_callback_does_not_end_the_loop():
    def broken_metrics(stats):
        raise ValueError("metrics bug")

    batcher = Batcher(lambda batch: [("done", w) for w in batch], tokens_of=lambda w: 1,
                      executor=ThreadPoolExecutor(1), max_batch_size=4, max_batch_tokens=100, max_wait_ms=1,
                      on_batch=broken_metrics)
    driver = Driver(batcher)
    assert await batcher.submit([("a", 1)]) == [("done", ("a", 1))]
    assert await batcher.submit([("b", 1)]) == [("done", ("b", 1))]
    assert driver.alive
    await driver.stop()
