"""Dynamic batching over real HTTP: concurrent requests of different lengths and settings share forward passes
and each gets exactly the numbers it gets alone."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from app.main import create_app
from tests.api.conftest import tiny_settings
from tests.conftest import live_server
from tests.gates import BatchGate, async_wait_until

MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


def make_requests(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while Paris is the capital of France".split()
    requests = []
    for i in range(n):
        body = {
            "query": " ".join(rng.choice(words) for _ in range(rng.randint(1, 25))),
            "label_token_ids": rng.sample(range(320), rng.randint(1, 6)),
            "logprobs_mode": MODES[i % 4],
            "top_logprobs": rng.choice([0, 3, 7]),
        }
        if i % 3 == 0:
            body["items"] = [" " + " ".join(rng.choice(words) for _ in range(rng.randint(0, 6))) for _ in range(3)]
        if i % 2 == 0:
            body.update(temperature=rng.choice([0.5, 1.7]), top_k=rng.choice([2, 40]), top_p=rng.choice([0.5, 0.95]))
        if i % 5 == 0:
            body["logit_bias"] = {str(body["label_token_ids"][0]): 3.0}
        requests.append(body)
    return requests


@pytest.fixture(scope="module")
def server(tiny_loaded):
    # 40 units fit one batch (max_batch_size and the padded-token budget), so a burst held behind a gate runs as one
    app = create_app(tiny_settings(max_batch_size=64, max_batch_tokens=64 * 64), loaded=tiny_loaded)
    with live_server(app) as base_url:
        gate = BatchGate(app.state.lifecycle.engine.batcher)
        yield base_url, app, gate
        gate.remove()


def values(response: dict) -> list:
    return [(d["label_logprobs"], d["label_ranks"], d["top_logprobs"]) for d in response["data"]]


def close(a, b, tol=1e-4) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, float):
        return abs(a - b) <= tol
    return a == b


def test_concurrent_requests_batch_together_and_match_alone(server):
    base_url, app, gate = server
    batcher = app.state.lifecycle.engine.batcher
    requests = make_requests(24)
    with httpx.Client(base_url=base_url, timeout=30) as client:
        alone = [client.post("/score", json=body).json() for body in requests]
    units = sum(len(b.get("items") or [None]) for b in requests)
    blocker = {"query": "hold the worker", "label_token_ids": [1]}

    async def burst():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            gate.hold()
            held = asyncio.create_task(client.post("/score", json=blocker))
            await async_wait_until(gate.entered.is_set, what="the blocker's batch to reach the gate")
            gate.sizes.clear()
            tasks = [asyncio.create_task(client.post("/score", json=body)) for body in requests]
            await async_wait_until(lambda: batcher.waiting == units, what="the whole burst to be queued")
            gate.release()
            await held
            return await asyncio.gather(*tasks)

    together = [r.json() for r in asyncio.run(burst())]
    assert gate.sizes == [1, units], f"the burst did not run as one batch: {gate.sizes}"
    for body, a, t in zip(requests, alone, together):
        assert t["logprobs_mode"] == body["logprobs_mode"]
        for va, vt in zip(values(a), values(t)):
            assert close(va[0], vt[0]) and close(va[2], vt[2]), body
            # A rank can move by one when two tokens' values are within float noise of each other.
            assert va[1] == vt[1] or max(abs(x - y) for x, y in zip(va[1], vt[1])) <= 1, (va[1], vt[1])


def test_a_bad_request_in_a_burst_does_not_touch_the_others(server):
    base_url, _, _ = server
    good = make_requests(6, seed=1)
    bad = {"query": "x", "label_token_ids": [10**6]}

    async def burst():
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            return await asyncio.gather(*(client.post("/score", json=b) for b in good[:3] + [bad] + good[3:]))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200, 200, 200, 400, 200, 200, 200]
