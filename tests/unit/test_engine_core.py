"""The engine core on its own (no HTTP), on the tiny Llama model: its one loop runs scoring batches between the decode
steps of a running generation, on its one device thread, and a dead loop fails scoring and generation callers alike.
Steps are ordered by gates, not time."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from app.engine.core import DEVICE_THREAD, Engine
from app.engine.results import ChoiceUpdate
from app.engine.work import GenerationParams, ScoreQuery
from app.errors import ServiceUnavailableError
from app.settings import Settings
from sampler import SamplingParams
from tests.gates import StepGate, async_wait_until


@contextlib.asynccontextmanager
async def started(loaded, **overrides):
    engine = Engine(loaded, Settings(model="unused", device="cpu", dtype="float32", **overrides))
    engine.start()
    await engine.warm_up()
    try:
        yield engine
    finally:
        await engine.stop()


async def test_a_score_is_answered_between_decode_steps_of_a_running_generation(tiny_loaded):
    async with started(tiny_loaded) as engine:
        gate = StepGate(engine.generator)
        threads: set[str] = set()
        hook = tiny_loaded.model.get_input_embeddings().register_forward_pre_hook(
            lambda *_: threads.add(threading.current_thread().name))
        try:
            generated: list[int] = []

            async def generate():
                params = GenerationParams(max_tokens=30, sampling=SamplingParams(temperature=0.0))
                async for event in engine.generate([5, 6, 7], params):
                    if isinstance(event, ChoiceUpdate):
                        generated.extend(event.token_ids)

            generation = asyncio.create_task(generate())
            await async_wait_until(lambda: len(gate.steps) >= 2, what="the generation to be decoding")
            gate.hold()  # the next decode step waits at the gate: the generation cannot finish meanwhile
            await async_wait_until(gate.entered.is_set, what="a decode step at the gate")
            steps_before = len(gate.steps)
            score = asyncio.create_task(engine.score(ScoreQuery([[8, 9, 10]], SamplingParams(label_token_ids=(5, 6)))))
            await async_wait_until(lambda: engine.batcher.waiting == 1, what="the score to queue")
            gate.release()
            result = await score
            steps_until_scored = len(gate.steps) - steps_before
            await generation
        finally:
            gate.remove()
            hook.remove()
    assert result.outcomes[0].labels is not None
    # the score ran right after the step in flight (the next may have started before the test looked), not after
    # the generation's 30 tokens
    assert steps_until_scored <= 2, steps_until_scored
    assert len(generated) == 30 or generated[-1] in engine.generator.stop_token_ids
    assert threads and all(name.startswith(DEVICE_THREAD) for name in threads), threads


async def test_a_dead_engine_loop_fails_scoring_and_generation_callers(tiny_loaded):
    async with started(tiny_loaded) as engine:
        gate = StepGate(engine.generator)
        gate.hold()
        try:
            async def generate():
                async for _ in engine.generate([5, 6, 7], GenerationParams(max_tokens=5)):
                    pass

            generation = asyncio.create_task(generate())
            await async_wait_until(gate.entered.is_set, what="the first generation step at the gate")
            waiting = asyncio.create_task(generate())
            await async_wait_until(lambda: engine.generator.waiting == 1, what="a second prompt to wait")
            score = asyncio.create_task(engine.score(ScoreQuery([[8, 9]], SamplingParams(label_token_ids=(5,)))))
            await async_wait_until(lambda: engine.batcher.waiting == 1, what="a score to queue")
            engine._task.cancel()  # as if a bug ended the loop
            for task in (waiting, score):
                with pytest.raises(ServiceUnavailableError, match="engine loop"):
                    await asyncio.wait_for(task, 30)
            assert not engine.alive
            with pytest.raises(ServiceUnavailableError, match="engine loop"):  # and new callers are refused
                await engine.score(ScoreQuery([[8, 9]], SamplingParams(label_token_ids=(5,))))
            with pytest.raises(ServiceUnavailableError, match="engine loop"):
                await generate()
        finally:
            gate.release()
            gate.remove()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(generation, 30)
