"""Generation through the engine alone (no HTTP, no scoring), on the tiny Llama model: admission under
max_batch_size, a caller that leaves, a wait list that is full, and a loop that dies with callers waiting. Steps are
ordered by gates, not time."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from app.engine.core import Engine
from app.engine.results import ChoiceUpdate
from app.engine.work import GenerationParams
from app.errors import OverloadedError, ServiceUnavailableError
from app.settings import Settings
from sampler import SamplingParams
from tests.gates import Step, StepGate, async_wait_until

GREEDY = SamplingParams(temperature=0.0)


def settings(**overrides) -> Settings:
    return Settings(model="unused", device="cpu", dtype="float32", **overrides)


async def collect(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = []
    async for update in engine.generate(prompt, GenerationParams(max_tokens=max_tokens, sampling=GREEDY)):
        if isinstance(update, ChoiceUpdate):
            tokens += update.token_ids
    return tokens


@contextlib.asynccontextmanager
async def started(loaded, **overrides):
    """An engine started in the test's own event loop, its generation step behind a gate: (engine, gate)."""
    engine = Engine(loaded, settings(**overrides))
    engine.start()
    gate = StepGate(engine.generator)
    try:
        yield engine, gate
    finally:
        gate.remove()
        await engine.stop()


async def test_admission_holds_prompts_beyond_max_batch_size(tiny_loaded):
    async with started(tiny_loaded, max_batch_size=2) as (engine, gate):
        alone = [await collect(engine, [5 + i, 6, 7], 3) for i in range(3)]
        gate.steps.clear()
        gate.hold()
        first = asyncio.create_task(collect(engine, [5, 6, 7], 3))
        await async_wait_until(gate.entered.is_set, what="the first step")
        rest = [asyncio.create_task(collect(engine, [5 + i, 6, 7], 3)) for i in (1, 2)]
        await async_wait_until(lambda: engine.generator.waiting == 2, what="two prompts to wait")
        gate.release()
        assert [await first, *[await t for t in rest]] == alone  # each as it would be alone
        # one row decoding, room for one more: the second joins it, the third waits for a free row
        assert gate.steps[:2] == [Step(admitted=1, running=0), Step(admitted=1, running=1)], gate.steps
        assert max(step.running for step in gate.steps) <= 2
        assert Step(admitted=1, running=1) in gate.steps[2:], gate.steps  # the third joined later


async def test_a_caller_that_leaves_has_its_row_dropped(tiny_loaded):
    async with started(tiny_loaded, max_batch_size=2) as (engine, gate):
        leaving = engine.generate([5, 6, 7], GenerationParams(max_tokens=50, sampling=GREEDY))
        async for _ in leaving:
            break  # the first update is enough: leave while the row decodes
        assert engine.generator.running == 1
        await leaving.aclose()
        steps_before = len(gate.steps)
        await collect(engine, [8, 9], 2)  # the next steps run without the leaver's row
        assert all(step.running <= 1 for step in gate.steps[steps_before:]), gate.steps
        assert engine.generator.running == 0


async def test_a_full_wait_list_is_refused_at_once(tiny_loaded):
    async with started(tiny_loaded, max_batch_size=1, max_queued_requests=1) as (engine, gate):
        gate.hold()
        running = asyncio.create_task(collect(engine, [5, 6], 2))
        await async_wait_until(gate.entered.is_set, what="the first step")
        waiting = asyncio.create_task(collect(engine, [7, 8], 2))
        await async_wait_until(lambda: engine.generator.waiting == 1, what="one prompt to wait")
        with pytest.raises(OverloadedError):
            await collect(engine, [9], 2)
        gate.release()
        assert len(await running) == 2 and len(await waiting) == 2


async def test_a_dead_loop_answers_every_waiting_caller_and_refuses_new_ones(tiny_loaded):
    async with started(tiny_loaded, max_batch_size=1) as (engine, gate):
        gate.hold()
        running = asyncio.create_task(collect(engine, [5, 6], 5))
        await async_wait_until(gate.entered.is_set, what="the first step")
        waiting = asyncio.create_task(collect(engine, [7, 8], 5))
        await async_wait_until(lambda: engine.generator.waiting == 1, what="one prompt to wait")

        def broken_admission():
            raise RuntimeError("injected: the loop itself fails")

        engine.generator._admit = broken_admission  # the next turn of the loop raises outside any step
        gate.release()
        for task in (running, waiting):
            with pytest.raises(ServiceUnavailableError):
                await task
        assert not engine.alive
        with pytest.raises(ServiceUnavailableError):
            await collect(engine, [9], 1)
