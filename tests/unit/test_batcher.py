"""The dynamic batcher: coalescing, limits, per-caller results, failures and cancellation."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.batcher import Batcher
from app.errors import EngineError, ServiceUnavailableError


class Recorder:
    """A handler that records each batch it gets and answers each unit with a function of it."""

    def __init__(self, answer=lambda w: ("done", w), fail_when=lambda batch: False, gate: threading.Event | None = None):
        self.batches: list[list] = []
        self.answer = answer
        self.fail_when = fail_when
        self.gate = gate

    def __call__(self, batch):
        if self.gate is not None:
            self.gate.wait(5)
        self.batches.append(list(batch))
        if self.fail_when(batch):
            raise RuntimeError("boom")
        return [self.answer(w) for w in batch]


def make(handler, **limits):
    options = dict(max_batch_size=8, max_batch_tokens=10_000, max_wait_ms=20)
    options.update(limits)
    return Batcher(handler, tokens_of=lambda w: w[1], executor=ThreadPoolExecutor(1), **options)


async def test_concurrent_callers_share_a_batch_and_get_their_own_results():
    handler = Recorder()
    batcher = make(handler)
    batcher.start()
    works = [[(f"a{i}", 3) for i in range(3)], [("b0", 5)], [(f"c{i}", 2) for i in range(2)]]
    results = await asyncio.gather(*(batcher.submit(w) for w in works))
    for submitted, got in zip(works, results):
        assert got == [("done", w) for w in submitted]
    assert len(handler.batches) == 1 and len(handler.batches[0]) == 6
    await batcher.stop()


async def test_batch_size_limit():
    handler = Recorder()
    batcher = make(handler, max_batch_size=4)
    batcher.start()
    results = await batcher.submit([(i, 1) for i in range(10)])
    assert [r[1][0] for r in results] == list(range(10))
    assert [len(b) for b in handler.batches] == [4, 4, 2]
    await batcher.stop()


async def test_token_budget_counts_padding():
    handler = Recorder()
    # budget 20 padded tokens: two of length 10 fit, a third would make 30
    batcher = make(handler, max_batch_tokens=20)
    batcher.start()
    await batcher.submit([("x", 10), ("y", 10), ("z", 10), ("long", 50)])
    sizes = [[w[0] for w in b] for b in handler.batches]
    assert sizes == [["x", "y"], ["z"], ["long"]]  # a unit over budget on its own still runs, alone
    for batch in handler.batches:
        assert len(batch) == 1 or max(w[1] for w in batch) * len(batch) <= 20
    await batcher.stop()


async def test_failed_batch_reaches_every_caller_and_loop_keeps_serving():
    handler = Recorder(fail_when=lambda batch: any(w[0] == "bad" for w in batch))
    batcher = make(handler)
    batcher.start()
    outcomes = await asyncio.gather(batcher.submit([("bad", 1)]), batcher.submit([("ok", 1)]), return_exceptions=True)
    assert all(isinstance(o, EngineError) for o in outcomes)
    assert "boom" not in str(outcomes[0])  # the cause goes to the log, not to clients
    assert await batcher.submit([("after", 1)]) == [("done", ("after", 1))]
    assert batcher.alive
    await batcher.stop()


async def test_cancelled_caller_never_reaches_the_handler():
    gate = threading.Event()
    handler = Recorder(gate=gate)
    batcher = make(handler, max_wait_ms=0)
    batcher.start()
    first = asyncio.create_task(batcher.submit([("first", 1)]))
    await asyncio.sleep(0.05)  # "first" is now running, blocked on the gate
    doomed = asyncio.create_task(batcher.submit([("doomed", 1)]))
    survivor = asyncio.create_task(batcher.submit([("survivor", 1)]))
    await asyncio.sleep(0.02)
    doomed.cancel()
    gate.set()
    assert await first == [("done", ("first", 1))]
    assert await survivor == [("done", ("survivor", 1))]
    with pytest.raises(asyncio.CancelledError):
        await doomed
    seen = [w[0] for b in handler.batches for w in b]
    assert "doomed" not in seen and batcher.alive
    await batcher.stop()


async def test_dead_loop_fails_waiting_callers_and_refuses_new_ones():
    gate = threading.Event()
    batcher = make(Recorder(gate=gate), max_wait_ms=0)
    batcher.start()
    running = asyncio.create_task(batcher.submit([("running", 1)]))
    await asyncio.sleep(0.05)
    queued = asyncio.create_task(batcher.submit([("queued", 1)]))
    await asyncio.sleep(0.01)
    batcher._task.cancel()  # the loop dies (as an unexpected bug would end it)
    await asyncio.sleep(0.01)
    gate.set()
    for task in (running, queued):
        with pytest.raises(ServiceUnavailableError):
            await asyncio.wait_for(task, 2)
    assert not batcher.alive
    with pytest.raises(ServiceUnavailableError):
        await batcher.submit([("late", 1)])


async def test_wrong_result_count_is_an_error_not_a_hang():
    batcher = Batcher(lambda batch: [], tokens_of=lambda w: 1, executor=ThreadPoolExecutor(1),
                      max_batch_size=4, max_batch_tokens=100, max_wait_ms=1)
    batcher.start()
    with pytest.raises(EngineError):
        await asyncio.wait_for(batcher.submit([("a", 1)]), 2)
    await batcher.stop()
