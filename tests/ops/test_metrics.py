"""GET /metrics on a live tiny-model server: parsed with prometheus_client's parser; the numbers move as requests are made."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from tests.api.conftest import TINY_NAME, tiny_settings
from tests.conftest import live_server

GENSCORE_METRICS = {
    "genscore_http_requests": "counter",
    "genscore_http_request_duration_seconds": "histogram",
    "genscore_http_requests_in_progress": "gauge",
    "genscore_queue_wait_seconds": "histogram",
    "genscore_forward_seconds": "histogram",
    "genscore_batch_size": "histogram",
    "genscore_batch_padded_tokens": "histogram",
    "genscore_prompt_tokens": "counter",
    "genscore_generation_tokens": "counter",
    "genscore_model_info": "gauge",
    "genscore_model_load_seconds": "gauge",
    "genscore_requests_waiting": "gauge",
    "genscore_requests_running": "gauge",
    "genscore_engine_waiting": "gauge",
    "genscore_engine_running": "gauge",
}


class Scrape:
    """One parsed /metrics answer: sample values by (name, labels)."""

    def __init__(self, text: str):
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for f in self.families.values() for s in f.samples}

    def value(self, name: str, **labels) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def server(tiny_loaded):
    # max_wait_ms 0: a batch runs as soon as the worker is free, so the queue test controls batching itself.
    app = create_app(tiny_settings(max_wait_ms=0, max_batch_size=4), loaded=tiny_loaded)
    with live_server(app) as base_url:
        yield base_url, app


def _wait_for(condition, failure: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


def scrape(base_url: str) -> Scrape:
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return Scrape(response.text)


def test_every_metric_is_exposed_with_its_type(server):
    base_url, _ = server
    families = scrape(base_url).families
    for name, kind in GENSCORE_METRICS.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, f"{name} is a {families[name].type}, expected {kind}"
    assert not any(name.endswith("_created") for name in families), "created series are disabled"
    assert "process_resident_memory_bytes" in families


def test_model_info(server):
    base_url, _ = server
    metrics = scrape(base_url)
    assert metrics.value("genscore_model_info", model=TINY_NAME, device="cpu", dtype="float32") == 1.0
    assert metrics.value("genscore_model_load_seconds") > 0


def test_score_requests_move_the_numbers(server):
    base_url, _ = server
    before = scrape(base_url)
    body = {"query": "The quick brown fox", "items": [" jumps", " over the lazy dog"], "label_token_ids": [1, 2]}
    answers = [httpx.post(f"{base_url}/score", json=body, timeout=30) for _ in range(3)]
    assert all(a.status_code == 200 for a in answers)
    prompt_tokens = sum(a.json()["usage"]["prompt_tokens"] for a in answers)
    bad = httpx.post(f"{base_url}/score", json={"query": "x", "label_token_ids": [10**9]}, timeout=30)
    assert bad.status_code == 400
    assert httpx.get(f"{base_url}/no/such/path/12345", timeout=10).status_code == 404
    after = scrape(base_url)

    def delta(name: str, **labels) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    score_ok = {"route": "/score", "method": "POST", "status": "200"}
    assert delta("genscore_http_requests_total", **score_ok) == 3
    assert delta("genscore_http_requests_total", route="/score", method="POST", status="400") == 1
    # Unknown paths share one label value: raw paths would make the label set unbounded.
    assert delta("genscore_http_requests_total", route="unmatched", method="GET", status="404") == 1
    assert not any(name == "genscore_http_requests_total" and dict(labels).get("route", "").startswith("/no/")
                   for name, labels in after.samples)
    # Latency of all four /score requests (the 400 included: it was answered too).
    assert delta("genscore_http_request_duration_seconds_count", route="/score", method="POST") == 4
    assert delta("genscore_http_request_duration_seconds_sum", route="/score", method="POST") > 0
    assert delta("genscore_http_request_duration_seconds_bucket", route="/score", method="POST", le="+Inf") == 4
    # Only answered requests count their tokens; the 400 ran nothing through the model.
    assert delta("genscore_prompt_tokens_total") == prompt_tokens > 0
    assert delta("genscore_generation_tokens_total") == 0
    # Each request's two sequences went through forward passes: at least one batch per request, 6 sequences.
    batches = delta("genscore_batch_size_count")
    assert 3 <= batches <= 6
    assert delta("genscore_batch_size_sum") == 6
    assert delta("genscore_batch_padded_tokens_sum") >= prompt_tokens
    assert delta("genscore_forward_seconds_count") == batches and delta("genscore_forward_seconds_sum") > 0
    assert delta("genscore_queue_wait_seconds_count") == batches
    # Histogram buckets are cumulative and end at the count.
    buckets = sorted(((float(dict(labels)["le"]), value) for (name, labels), value in after.samples.items()
                      if name == "genscore_batch_size_bucket"), key=lambda item: item[0])
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert buckets[-1] == (math.inf, after.value("genscore_batch_size_count"))
    # The probes are counted under their own routes.
    httpx.get(f"{base_url}/ready", timeout=10)
    assert scrape(base_url).value("genscore_http_requests_total", route="/ready", method="GET", status="200") >= 1


def test_waiting_and_running_gauges_follow_the_queue(server):
    """Hold the single forward-pass thread; requests then pile up: one batch running, the rest waiting."""
    base_url, app = server
    engine = app.state.lifecycle.engine
    idle = scrape(base_url)
    assert idle.value("genscore_requests_waiting") == 0 and idle.value("genscore_requests_running") == 0
    body = {"query": "Paris is the capital of", "items": [" France", " Germany"], "label_token_ids": [5]}
    gate = threading.Event()
    # The engine's worker is one thread: a job that waits on the gate keeps every forward pass behind it.
    blocker = engine.device.submit(gate.wait, 120)  # released by the test, never by its timeout
    # The idle engine's upkeep (giving freed memory back to the OS) falls due now, and queues behind the held device
    # thread, as it does whenever work ends just before the device is busy: the scheduler must not wait behind it.
    engine._trim_due, engine._trimmed_at = True, 0.0
    engine._wake.set()
    _wait_for(lambda: engine.device._work_queue.qsize() == 1, "the upkeep never reached the device thread")
    n_requests = 5  # 10 sequences; the first batch (one or two requests' worth) runs, the rest wait behind it
    try:
        with ThreadPoolExecutor(n_requests) as pool:
            futures = [pool.submit(httpx.post, f"{base_url}/score", json=body, timeout=60) for _ in range(n_requests)]
            deadline = time.monotonic() + 30
            while True:
                metrics = scrape(base_url)
                running = metrics.value("genscore_requests_running")
                waiting = metrics.value("genscore_requests_waiting")
                if running and running + waiting == 2 * n_requests:
                    break
                assert time.monotonic() < deadline, f"queue never filled: running={running}, waiting={waiting}"
                time.sleep(0.02)
            assert running in (2, 4)  # whole requests, up to max_batch_size sequences
            # the engine's backlog (what the autoscaler reads) holds the scoring queue; nothing is generating
            assert (metrics.value("genscore_engine_waiting"), metrics.value("genscore_engine_running")) == (
                waiting, running)
            # Every HTTP request is in progress, and so is this scrape.
            assert metrics.value("genscore_http_requests_in_progress") == n_requests + 1
            gate.set()
            answers = [f.result() for f in futures]
    finally:
        gate.set()
        blocker.result(timeout=30)
    assert all(a.status_code == 200 for a in answers)
    done = scrape(base_url)
    assert done.value("genscore_requests_waiting") == 0 and done.value("genscore_requests_running") == 0
    assert done.value("genscore_http_requests_in_progress") == 1
    assert done.value("genscore_batch_size_sum") - idle.value("genscore_batch_size_sum") == 2 * n_requests
