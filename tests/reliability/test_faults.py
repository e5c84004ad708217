"""Fault injection over real HTTP: a batch that fails, a request that fails on its own, out-of-memory batches, a dead
engine loop, and a model that is missing or broken at start-up."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import free_port
from tests.gates import Step, StepGate
from tests.reliability.conftest import (
    POISON,
    answer,
    async_wait_until,
    bisection,
    poisoned_row,
    same_answer,
    score_body,
    serving,
)

GOOD = [[5, 6, 7, 8], [20, 21], [30, 31, 32, 33, 34, 35], [40], [50, 51, 52], [60, 61, 62, 63, 64], [70, 71]]
BAD = [1, POISON, 2]


def poison_fault(ids: torch.Tensor):
    if (ids == POISON).any():
        return RuntimeError("injected fault: this batch holds a poisoned sequence")
    return None


async def held_burst(base_url: str, app, probe, bodies: list[dict]) -> list[httpx.Response]:
    """Hold the model on a blocker request, queue every body behind it, then let go: the bodies reach the model as
    one batch (the test asserts it from the batch sizes the probe saw)."""
    batcher = app.state.lifecycle.engine.batcher
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        probe.entered.clear()
        probe.gate.clear()
        blocker = asyncio.create_task(client.post("/score", json=score_body([3, 4])))
        await async_wait_until(probe.entered.is_set, what="the blocker to reach the model")
        tasks = [asyncio.create_task(client.post("/score", json=b)) for b in bodies]
        await async_wait_until(lambda: batcher.waiting == len(bodies), what="the burst to be queued")
        probe.batch_sizes.clear()
        probe.passes.clear()
        probe.gate.set()
        assert (await blocker).status_code == 200
        return list(await asyncio.gather(*tasks))


def assert_engine_error(response: httpx.Response) -> None:
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_server_error" and "injected" not in error["message"]  # cause stays in the log


def test_failing_batch_is_split_and_only_the_failing_request_gets_500(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=16) as (base_url, app):
        alone = [answer(httpx.post(f"{base_url}/score", json=score_body(ids), timeout=30)) for ids in GOOD]
        probe.fault = poison_fault
        bodies = [score_body(ids) for ids in GOOD[:3]] + [score_body(BAD)] + [score_body(ids) for ids in GOOD[3:]]
        responses = asyncio.run(held_burst(base_url, app, probe, bodies))
        assert_engine_error(responses[3])
        good = responses[:3] + responses[4:]
        assert [r.status_code for r in good] == [200] * len(GOOD)
        for expected, got in zip(alone, good):
            assert same_answer(expected, answer(got))
        # after the blocker (1), the 8 shared one batch, which failed and was split in halves down to the poisoned
        # unit alone (where it sits in the batch depends on which connection the server read first)
        assert probe.batch_sizes[:2] == [1, 8], f"the burst did not share a batch: {probe.batch_sizes}"
        assert probe.batch_sizes[1:] == bisection(8, poisoned_row(probe.passes[1]))
        assert httpx.get(f"{base_url}/health").status_code == 200
        probe.fault = lambda ids: None
        assert httpx.post(f"{base_url}/score", json=score_body(GOOD[0]), timeout=30).status_code == 200


def test_request_that_fails_on_its_own_is_500_and_its_items_do_not_run_after(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=1) as (base_url, _):
        probe.fault = poison_fault
        body = {"query": [1, 2], "items": [[POISON], [99], [98]], "label_token_ids": [5]}
        assert_engine_error(httpx.post(f"{base_url}/score", json=body, timeout=30))
        assert not probe.reached_model([1, 2, 98])  # its later items were dropped with it
        assert httpx.post(f"{base_url}/score", json=score_body(GOOD[0]), timeout=30).status_code == 200


@pytest.mark.parametrize("make_oom", [
    lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
], ids=["cuda-oom", "cpu-oom"])
def test_out_of_memory_batches_are_retried_smaller_and_everyone_gets_the_right_answer(tiny_loaded, probe, make_oom):
    with serving(tiny_loaded, max_batch_size=16) as (base_url, app):
        alone = [answer(httpx.post(f"{base_url}/score", json=score_body(ids), timeout=30)) for ids in GOOD]
        probe.fault = lambda ids: make_oom() if ids.shape[0] > 2 else None  # the "device" fits 2 sequences
        responses = asyncio.run(held_burst(base_url, app, probe, [score_body(ids) for ids in GOOD]))
        assert [r.status_code for r in responses] == [200] * len(GOOD)
        for expected, got in zip(alone, responses):
            assert same_answer(expected, answer(got))
        # after the blocker (1), the 7 ran out of memory together, then in halves until every piece fit
        assert probe.batch_sizes == [1, 7, 3, 1, 2, 4, 2, 2], probe.batch_sizes


def test_dead_batcher_loop_fails_every_waiting_caller_at_once_and_health(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=1) as (base_url, app):
        batcher = app.state.lifecycle.engine.batcher

        async def scenario():
            probe.gate.clear()
            probe.entered.clear()
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                running = asyncio.create_task(client.post("/score", json=score_body(GOOD[0])))
                await async_wait_until(probe.entered.is_set, what="the first batch to start")
                queued = [asyncio.create_task(client.post("/score", json=score_body(ids))) for ids in GOOD[1:4]]
                await async_wait_until(lambda: batcher.waiting == 3, what="three queued requests")

                async def bug(*_):
                    raise RuntimeError("injected bug in the engine loop")

                batcher.collect = bug  # the engine's next step calls this, once the running batch is done: it dies there
                probe.gate.set()
                return await running, await asyncio.gather(*queued)

        running, queued = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert running.status_code == 200  # the batch that was already computing is answered
        for response in queued:
            assert response.status_code == 503 and "batcher" in response.json()["error"]["message"]
        assert not app.state.lifecycle.engine.alive
        health = httpx.get(f"{base_url}/health")
        assert health.status_code == 503 and "batcher" in health.json()["error"]["message"]
        assert httpx.post(f"{base_url}/score", json=score_body(GOOD[0]), timeout=10).status_code == 503


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    genscore = Path(sys.executable).with_name("genscore")
    # 127.0.0.1 always, and no GENSCORE_* settings from the environment (a container sets GENSCORE_HOST=0.0.0.0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENSCORE_")}
    return subprocess.run([str(genscore), "serve", "--host", "127.0.0.1", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, env=env)


def test_missing_model_exits_non_zero_with_a_clear_message():
    result = run_cli("--model", "/missing/model")
    assert result.returncode != 0
    assert "model path not found" in result.stderr and "/missing/model" in result.stderr
    assert "Traceback" not in result.stderr


def test_broken_model_folder_exits_non_zero_with_a_clear_message(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": "not a number"')
    result = run_cli("--model", str(tmp_path), "--device", "cpu")
    assert result.returncode == 1
    assert "model load failed" in result.stderr


def test_failing_prefill_is_split_and_only_the_failing_prompt_gets_500(tiny_loaded, probe):
    """Generation: newcomers prefilled together are retried alone when that fails; rows already decoding go on."""

    def prefill_fault(ids: torch.Tensor):
        # decode steps feed one token per row ([B, 1]); only a prefill holds the whole poisoned prompt
        return poison_fault(ids) if ids.shape[1] > 1 else None

    def completion(prompt: list[int], max_tokens: int = 4) -> dict:
        return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}

    prompts = [[5, 6, 7, 8], [20, 21, 22], BAD, [30, 31, 32, 33, 34]]
    bodies = [completion(prompts[0], max_tokens=8)] + [completion(p) for p in prompts[1:]]
    with serving(tiny_loaded) as (base_url, app):
        alone = {i: httpx.post(f"{base_url}/v1/completions", json=b, timeout=30).json()
                 for i, b in enumerate(bodies) if b["prompt"] is not BAD}
        generator = app.state.lifecycle.generator
        gate = StepGate(generator)
        probe.fault = prefill_fault

        async def scenario():
            # the first prompt's step is held; the others queue behind it and are admitted together in the next
            # step, while the first is decoding
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                gate.hold()
                first = asyncio.create_task(client.post("/v1/completions", json=bodies[0]))
                await async_wait_until(gate.entered.is_set, what="the first step")
                rest = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies[1:]]
                await async_wait_until(lambda: len(generator._waiting) == 3, what="the others to queue")
                probe.passes.clear()
                gate.release()
                return [await first] + [await task for task in rest]

        try:
            responses = asyncio.run(scenario())
        finally:
            gate.remove()
        assert Step(admitted=3, running=1) in gate.steps, gate.steps  # the newcomers met a decoding row
        prefills = [rows for rows in probe.passes if len(rows[0]) > 1]
        # the first's own prefill, then the three newcomers together (failed), then in halves down to BAD alone
        assert [len(rows) for rows in prefills] == [1] + bisection(3, poisoned_row(prefills[1])), probe.passes
        assert_engine_error(responses[2])
        for i in (0, 1, 3):
            assert responses[i].status_code == 200, responses[i].text
            got, expected = responses[i].json()["choices"][0], alone[i]["choices"][0]
            assert got["text"] == expected["text"]
            assert got["logprobs"]["token_logprobs"] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-4)
        assert httpx.get(f"{base_url}/health").status_code == 200
