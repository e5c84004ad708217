"""Fault injection over real HTTP: a batch that fails, a request that fails on its own, out-of-memory batches, a dead
batcher loop, and a model that is missing or broken at start-up."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import free_port
from tests.reliability.conftest import POISON, answer, async_wait_until, same_answer, score_body, serving

GOOD = [[5, 6, 7, 8], [20, 21], [30, 31, 32, 33, 34, 35], [40], [50, 51, 52], [60, 61, 62, 63, 64], [70, 71]]
BAD = [1, POISON, 2]


def poison_fault(ids: torch.Tensor):
    if (ids == POISON).any():
        return RuntimeError("injected fault: this batch holds a poisoned sequence")
    return None


async def burst(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        return list(await asyncio.gather(*(client.post("/score", json=b) for b in bodies)))


def assert_engine_error(response: httpx.Response) -> None:
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_server_error" and "injected" not in error["message"]  # cause stays in the log


def test_failing_batch_is_split_and_only_the_failing_request_gets_500(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=16, max_wait_ms=100) as (base_url, _):
        alone = [answer(httpx.post(f"{base_url}/score", json=score_body(ids), timeout=30)) for ids in GOOD]
        probe.fault = poison_fault
        probe.batch_sizes.clear()
        bodies = [score_body(ids) for ids in GOOD[:3]] + [score_body(BAD)] + [score_body(ids) for ids in GOOD[3:]]
        responses = asyncio.run(burst(base_url, bodies))
        assert_engine_error(responses[3])
        good = responses[:3] + responses[4:]
        assert [r.status_code for r in good] == [200] * len(GOOD)
        for expected, got in zip(alone, good):
            assert same_answer(expected, answer(got))
        assert probe.batch_sizes[0] > 2, f"the burst did not share a batch: {probe.batch_sizes}"
        assert probe.batch_sizes.count(1) >= 1  # bisected down to the poisoned unit alone
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
    with serving(tiny_loaded, max_batch_size=16, max_wait_ms=100) as (base_url, _):
        alone = [answer(httpx.post(f"{base_url}/score", json=score_body(ids), timeout=30)) for ids in GOOD]
        probe.fault = lambda ids: make_oom() if ids.shape[0] > 2 else None  # the "device" fits 2 sequences
        probe.batch_sizes.clear()
        responses = asyncio.run(burst(base_url, [score_body(ids) for ids in GOOD]))
        assert [r.status_code for r in responses] == [200] * len(GOOD)
        for expected, got in zip(alone, responses):
            assert same_answer(expected, answer(got))
        assert max(probe.batch_sizes) > 2  # a batch did run out of memory and was split


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
                    raise RuntimeError("injected bug in the batcher loop")

                batcher._collect = bug  # the loop calls this next, once the running batch is done: it dies there
                probe.gate.set()
                return await running, await asyncio.gather(*queued)

        running, queued = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert running.status_code == 200  # the batch that was already computing is answered
        for response in queued:
            assert response.status_code == 503 and "batcher" in response.json()["error"]["message"]
        assert not batcher.alive
        health = httpx.get(f"{base_url}/health")
        assert health.status_code == 503 and "batcher" in health.json()["error"]["message"]
        assert httpx.post(f"{base_url}/score", json=score_body(GOOD[0]), timeout=10).status_code == 503


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    genscore = Path(sys.executable).with_name("genscore")
    return subprocess.run([str(genscore), "serve", "--port", str(free_port()), *args], capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


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

    def completion(prompt: list[int]) -> dict:
        return {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1}

    prompts = [[5, 6, 7, 8], [20, 21, 22], BAD, [30, 31, 32, 33, 34]]
    with serving(tiny_loaded) as (base_url, _):
        alone = {i: httpx.post(f"{base_url}/v1/completions", json=completion(p), timeout=30).json()
                 for i, p in enumerate(prompts) if p is not BAD}
        probe.fault = prefill_fault
        probe.gate.clear()  # hold the first prefill so the others queue up and are admitted together

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                first = asyncio.create_task(client.post("/v1/completions", json=completion(prompts[0])))
                await async_wait_until(probe.entered.is_set, what="the first prefill")
                rest = [asyncio.create_task(client.post("/v1/completions", json=completion(p))) for p in prompts[1:]]
                await asyncio.sleep(0.2)  # the others are queued behind the held step
                probe.gate.set()
                return [await first] + [await task for task in rest]

        responses = asyncio.run(scenario())
        assert_engine_error(responses[2])
        for i in (0, 1, 3):
            assert responses[i].status_code == 200, responses[i].text
            got, expected = responses[i].json()["choices"][0], alone[i]["choices"][0]
            assert got["text"] == expected["text"]
            assert got["logprobs"]["token_logprobs"] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-4)
        assert httpx.get(f"{base_url}/health").status_code == 200
