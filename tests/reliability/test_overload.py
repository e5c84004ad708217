"""Overload and limits over real HTTP on 127.0.0.1: a full admission queue (503 + Retry-After), deadlines (504),
clients that disconnect (their queued work never reaches the model) and the request body cap (413)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from app.api.score import serving as score_serving
from tests.reliability.conftest import async_wait_until, score_body, serving

HELD = [5, 6, 7]  # the request that holds the model at the gate while others queue


def assert_error(response: httpx.Response, status: int, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


async def hold_the_model(client: httpx.AsyncClient, probe) -> asyncio.Task:
    """Start a request and wait until its forward pass is parked at the gate."""
    probe.gate.clear()
    probe.entered.clear()
    task = asyncio.create_task(client.post("/score", json=score_body(HELD)))
    await async_wait_until(probe.entered.is_set, what="the held batch to start")
    return task


def test_full_queue_is_refused_at_once_with_retry_after(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=1, max_queued_requests=3, retry_after_s=2) as (base_url, app):
        batcher = app.state.lifecycle.engine.batcher

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                held = await hold_the_model(client, probe)
                queued = [asyncio.create_task(client.post("/score", json=score_body([20 + i]))) for i in range(2)]
                await async_wait_until(lambda: batcher.admitted == 3, what="a full queue")
                refused = await client.post("/score", json=score_body([90, 91]))
                probe.gate.set()
                return refused, await held, await asyncio.gather(*queued)

        refused, held, queued = asyncio.run(asyncio.wait_for(scenario(), 30))
        error = assert_error(refused, 503, "max_queued_requests")
        assert refused.headers["retry-after"] == "2" and error["code"] == "overloaded"
        assert held.status_code == 200 and [r.status_code for r in queued] == [200, 200]
        assert not probe.reached_model([90, 91])
        assert batcher.admitted == 0
        assert httpx.post(f"{base_url}/score", json=score_body([90, 91]), timeout=30).status_code == 200


def test_open_request_cap_refuses_before_reading_and_never_blocks_probes(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=1, max_open_requests=2, retry_after_s=3) as (base_url, app):
        batcher = app.state.lifecycle.engine.batcher

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                held = await hold_the_model(client, probe)
                queued = asyncio.create_task(client.post("/score", json=score_body([21])))
                await async_wait_until(lambda: batcher.admitted == 2, what="two open requests")
                refused = await client.post("/score", json=score_body([92]))
                probes = [(await client.get(path)).status_code for path in ("/health", "/ready")]
                probe.gate.set()
                return refused, probes, await held, await queued

        refused, probes, held, queued = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert_error(refused, 503, "max_open_requests")
        assert refused.headers["retry-after"] == "3"
        assert probes == [200, 200]
        assert held.status_code == 200 and queued.status_code == 200
        assert httpx.post(f"{base_url}/score", json=score_body([92]), timeout=30).status_code == 200


def test_deadline_passing_in_the_queue_is_504_and_the_work_never_runs(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=1) as (base_url, _):

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                held = await hold_the_model(client, probe)
                late = await client.post("/score", json=score_body([80, 81]), headers={"X-Request-Timeout": "0.2"})
                probe.gate.set()
                return late, await held

        late, held = asyncio.run(asyncio.wait_for(scenario(), 30))
        error = assert_error(late, 504, "deadline")
        assert error["type"] == "timeout_error"
        assert held.status_code == 200
        assert not probe.reached_model([80, 81])


def test_server_deadline_setting_applies_without_a_header(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=1, request_timeout_s=0.2) as (base_url, _):

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                held = await hold_the_model(client, probe)
                # a header cannot lengthen the server's deadline, only shorten it
                late = await client.post("/score", json=score_body([82]), headers={"X-Request-Timeout": "60"})
                probe.gate.set()
                return late, await held

        late, held = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert_error(late, 504)
        assert held.status_code == 200  # work that started before its deadline passed is finished and answered


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf"])
def test_bad_timeout_header_is_400_naming_it(client, value):
    response = client.post("/score", json=score_body([5]), headers={"X-Request-Timeout": value})
    assert assert_error(response, 400)["param"] == "X-Request-Timeout"


def test_client_that_disconnects_has_its_queued_work_dropped(tiny_loaded, probe):
    with serving(tiny_loaded, max_batch_size=1) as (base_url, app):
        batcher = app.state.lifecycle.engine.batcher

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                held = await hold_the_model(client, probe)
                async with httpx.AsyncClient(base_url=base_url) as impatient:
                    with pytest.raises(httpx.ReadTimeout):  # gives up and closes its connection
                        await impatient.post("/score", json=score_body([70, 71, 72]), timeout=0.3)
                # uvicorn reports the disconnect; the guard cancels the request and the batcher forgets its unit
                await async_wait_until(lambda: batcher.admitted == 1, what="the disconnected request to be dropped")
                probe.gate.set()
                return await held

        assert asyncio.run(asyncio.wait_for(scenario(), 30)).status_code == 200
        assert not probe.reached_model([70, 71, 72])
        assert httpx.post(f"{base_url}/score", json=score_body([5]), timeout=30).status_code == 200


def test_oversized_body_is_413_naming_the_limit_declared_or_chunked(tiny_loaded):
    limit = 2000
    with serving(tiny_loaded, max_body_bytes=limit) as (base_url, _):
        with httpx.Client(base_url=base_url, timeout=30) as client:
            big = score_body([5] * 1500)
            declared = client.post("/score", json=big)  # Content-Length says too much: refused before reading
            error = assert_error(declared, 413, str(limit), "max_body_bytes")
            assert error["code"] == "request_too_large"

            def chunks():  # no Content-Length: the bytes are counted as they arrive
                payload = httpx.Request("POST", "/", json=big).content
                for i in range(0, len(payload), 500):
                    yield payload[i:i + 500]

            chunked = client.post("/score", content=chunks(), headers={"content-type": "application/json"})
            assert "content-length" not in chunked.request.headers
            assert_error(chunked, 413, str(limit))
            fits = score_body([5] * 100)
            assert len(httpx.Request("POST", "/", json=fits).content) < limit
            assert client.post("/score", json=fits).status_code == 200
            assert client.get("/health").status_code == 200


def test_tokenizing_a_long_text_does_not_stall_probes(tiny_loaded):
    """Tokenization runs off the event loop: held mid-tokenization, the server still answers its probes."""
    with serving(tiny_loaded) as (base_url, app):
        entered, gate = threading.Event(), threading.Event()
        original = score_serving.score_query

        def held_tokenization(*args):
            entered.set()
            gate.wait(30)  # on the event loop this would freeze the whole server
            return original(*args)

        score_serving.score_query = held_tokenization

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
                long_text = " ".join(["the quick brown fox"] * 20_000)  # about 400 KB
                scored = asyncio.create_task(client.post("/score", json={"query": long_text, "label_token_ids": [5]}))
                await async_wait_until(entered.is_set, what="tokenization to start")
                probes = [(await client.get(path)).status_code for path in ("/health", "/ready")]
                gate.set()
                return probes, await scored

        try:
            probes, scored = asyncio.run(asyncio.wait_for(scenario(), 30))
        finally:
            gate.set()
            score_serving.score_query = original
        assert probes == [200, 200]
        assert_error(scored, 400, "tokens")  # far longer than the model's 128 positions
