"""The generation routes under the same limits as scoring, over real HTTP: the max_tokens cap (400), a bounded
wait list (503 + Retry-After), the deadline while waiting (504) and a client that disconnects (its prompt never
reaches the model)."""

from __future__ import annotations

import asyncio

import httpx

from tests.reliability.conftest import async_wait_until, serving
from tests.reliability.test_overload import assert_error

HELD = [5, 6, 7]  # a completion whose first forward pass holds the model at the gate


def completion(ids: list[int], **extra) -> dict:
    return {"prompt": ids, "max_tokens": 3, "temperature": 0, **extra}


async def hold_the_generator(client: httpx.AsyncClient, probe) -> asyncio.Task:
    probe.gate.clear()
    probe.entered.clear()
    task = asyncio.create_task(client.post("/v1/completions", json=completion(HELD)))
    await async_wait_until(probe.entered.is_set, what="the held generation to start")
    return task


def test_max_tokens_over_the_cap_is_400_naming_the_limit(tiny_loaded):
    with serving(tiny_loaded, max_generated_tokens=4) as (base_url, _):
        refused = httpx.post(f"{base_url}/v1/completions", json=completion([5], max_tokens=5), timeout=30)
        error = assert_error(refused, 400, "max_generated_tokens", "4")
        assert error["param"] == "max_tokens"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
        assert assert_error(httpx.post(f"{base_url}/v1/chat/completions", json=chat, timeout=30), 400,
                            "max_generated_tokens")["param"] == "max_completion_tokens"
        fits = httpx.post(f"{base_url}/v1/completions", json=completion([5], max_tokens=4), timeout=30)
        assert fits.status_code == 200
        # a chat request that names no limit gets the cap as its default, not an error
        unlimited = httpx.post(f"{base_url}/v1/chat/completions", json={**chat, "max_completion_tokens": None},
                               timeout=60)
        assert unlimited.status_code == 200 and unlimited.json()["usage"]["completion_tokens"] <= 4


def test_full_generation_wait_list_is_503_and_a_passed_deadline_is_504(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=1, max_queued_requests=1, retry_after_s=4) as (base_url, app):
        generator = app.state.lifecycle.generator

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                held = await hold_the_generator(client, probe)
                late = await client.post("/v1/completions", json=completion([80, 81]),
                                         headers={"X-Request-Timeout": "0.2"})
                waiting = asyncio.create_task(client.post("/v1/completions", json=completion([21])))
                await async_wait_until(lambda: len(generator._waiting) == 1, what="one waiting prompt")
                refused = await client.post("/v1/completions", json=completion([92, 93]))
                probe.gate.set()
                return late, refused, await held, await waiting

        late, refused, held, waiting = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert assert_error(late, 504, "deadline")["type"] == "timeout_error"
        assert_error(refused, 503, "max_queued_requests")
        assert refused.headers["retry-after"] == "4"
        assert held.status_code == 200 and waiting.status_code == 200
        assert not probe.reached_model([80, 81]) and not probe.reached_model([92, 93])


def test_disconnected_generation_client_never_reaches_the_model(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=1) as (base_url, app):
        generator = app.state.lifecycle.generator

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                held = await hold_the_generator(client, probe)
                async with httpx.AsyncClient(base_url=base_url) as impatient:
                    try:
                        await impatient.post("/v1/completions", json=completion([70, 71, 72]), timeout=0.3)
                    except httpx.ReadTimeout:
                        pass
                await async_wait_until(lambda: not generator._waiting, what="the abandoned prompt to be dropped")
                probe.gate.set()
                return await held

        assert asyncio.run(asyncio.wait_for(scenario(), 60)).status_code == 200
        assert not probe.reached_model([70, 71, 72])
