"""Every model call runs on one thread: the model's load and self-check, and then a mixed load of concurrent /score
requests and streamed completions (two threads would mean two OpenMP teams; app/engine/device.py says why that is slow)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

import app.main
from app.main import DEVICE_THREAD, create_app
from tests.api.conftest import tiny_settings
from tests.conftest import live_server, wait_ready


def test_mixed_load_runs_every_model_call_on_the_device_thread(tiny_loaded):
    threads: set[str] = set()
    lock = threading.Lock()

    def record(_module, _args):
        with lock:
            threads.add(threading.current_thread().name)

    hook = tiny_loaded.model.get_input_embeddings().register_forward_pre_hook(record)
    try:
        with live_server(create_app(tiny_settings(), loaded=tiny_loaded)) as url:
            threads.clear()  # warm-up is over; from here on only the callers' work

            def score(i: int) -> int:
                body = {"query": "The quick brown fox" + " jumps" * i, "label_token_ids": [5, 6]}
                return httpx.post(f"{url}/score", json=body, timeout=60).status_code

            def stream(i: int) -> int:
                body = {"model": "tiny-llama", "prompt": "Paris is" + " the" * i, "max_tokens": 12, "stream": True}
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                    chunks = sum(1 for line in response.iter_lines() if line.startswith("data: "))
                return response.status_code if chunks > 1 else -1

            with ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(score if i % 2 else stream, i) for i in range(16)]
                assert [f.result() for f in futures] == [200] * 16
    finally:
        hook.remove()
    assert threads and all(name.startswith(DEVICE_THREAD) for name in threads), threads
    assert len(threads) == 1, threads


def test_the_model_loads_on_the_thread_that_serves_it(tiny_model_dirs, monkeypatch):
    load_threads: list[int] = []
    serve_threads: set[int] = set()
    real_load = app.main.load_model

    def recording_load(*args, **kwargs):
        load_threads.append(threading.get_ident())
        loaded = real_load(*args, **kwargs)
        loaded.model.get_input_embeddings().register_forward_pre_hook(
            lambda _module, _args: serve_threads.add(threading.get_ident()))
        return loaded

    monkeypatch.setattr(app.main, "load_model", recording_load)
    settings = tiny_settings().model_copy(update={"model": str(tiny_model_dirs["llama"])})
    from fastapi.testclient import TestClient

    with TestClient(create_app(settings)) as client:
        wait_ready(client, timeout_s=120)
        response = client.post("/score", json={"query": "The quick brown fox", "label_token_ids": [5, 6]})
        assert response.status_code == 200, response.text
    assert len(load_threads) == 1
    assert serve_threads == set(load_threads)


def test_requests_reach_the_engine_without_a_worker_thread_hop(client, monkeypatch):
    """The routes' dependencies run on the event loop: no request is handed to a thread pool on its way to the
    engine (each hop costs CPU that the forward's threads share on a small machine)."""
    import anyio.to_thread

    hops = []
    real = anyio.to_thread.run_sync

    async def counting(func, *args, **kwargs):
        hops.append(getattr(func, "__name__", repr(func)))
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
    assert client.post("/score", json={"query": "The quick brown fox", "label_token_ids": [5, 6]}).status_code == 200
    body = {"model": "tiny-llama", "prompt": "Paris is", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/tokenize", json={"prompt": "Paris is"}).status_code == 200
    assert hops == []
