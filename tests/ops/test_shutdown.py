"""Graceful shutdown: SIGTERM to a real `genscore serve` process with requests in flight; none is lost.

The server runs a tiny random model on 127.0.0.1 with a long batching wait (max_wait_ms), so
requests sent before SIGTERM are still queued in the batcher when the signal arrives: the
drain must run their forward pass after the signal and answer them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from app.server import DrainingServer
from tests.api.conftest import tiny_settings
from tests.conftest import free_port, wait_ready

BODY = {"query": "Paris is the capital of", "items": [" France", " Germany"], "label_token_ids": [1, 2, 3],
        "top_logprobs": 2}


class ServerProcess:
    """`genscore serve` in a subprocess on 127.0.0.1, JSON logs to a file; always killed on exit."""

    def __init__(self, model_dir: Path, workdir: Path, *flags: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        script = Path(sys.executable).parent / "genscore"
        command = [str(script)] if script.is_file() else [sys.executable, "-m", "app.cli"]
        command += ["serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port),
                    "--device", "cpu", "--dtype", "float32", "--cache-dir", str(workdir / "cache"),
                    "--log-format", "json", "--torch-threads", "1", *flags]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GENSCORE_")}
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200:
                    return
            assert self.process.poll() is None, f"server exited early:\n{self.log_path.read_text()}"
            assert time.monotonic() < deadline, f"server not ready:\n{self.log_path.read_text()}"
            time.sleep(0.1)

    def in_progress(self) -> float:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        family = next(f for f in text_string_to_metric_families(text) if f.name == "genscore_http_requests_in_progress")
        return family.samples[0].value

    def log_entries(self) -> list[dict]:
        lines = self.log_path.read_text().splitlines()
        entries = []
        for line in lines:
            try:
                entries.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"not a JSON log line: {line!r}") from None
        return entries

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._log.close()


@pytest.fixture
def serve(tiny_model_dirs, tmp_path):
    started: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        server = ServerProcess(tiny_model_dirs["llama"], tmp_path, *flags)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.close()


def post_score(base_url: str, request_id: str) -> tuple[httpx.Response | Exception, float]:
    """POST /score; returns the answer (or the error) and when it came back (time.monotonic())."""
    try:
        answer = httpx.post(f"{base_url}/score", json=BODY, headers={"X-Request-ID": request_id}, timeout=120)
    except httpx.HTTPError as exc:
        answer = exc
    return answer, time.monotonic()


def wait_for_in_progress(server: ServerProcess, count: int) -> None:
    """Until `count` requests (and this scrape) are being handled by the server."""
    deadline = time.monotonic() + 60
    while server.in_progress() < count + 1:
        assert time.monotonic() < deadline, "the requests never reached the server"
        time.sleep(0.02)


def reference_logprobs(tokenizer, plain) -> list[list[float]]:
    """Plain float32 transformers forward of each unpadded query + item: the label logprobs [item][label]."""
    query = tokenizer(BODY["query"])["input_ids"]
    rows = []
    for item in BODY["items"]:
        ids = query + tokenizer(item, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            logprobs = torch.log_softmax(plain(torch.tensor([ids])).logits[0, -1].float(), dim=-1)  # [V]
        rows.append(logprobs[BODY["label_token_ids"]].tolist())
    return rows


def test_sigterm_answers_every_request_in_flight(serve, tiny_loaded, plain_tiny):
    n_requests = 6
    # Batches close after 3 s unless 64 sequences arrive: the requests below wait in the batcher.
    server = serve("--max-wait-ms", "3000", "--max-batch-size", "64", "--drain-timeout-s", "60")
    expected = reference_logprobs(tiny_loaded.tokenizer, plain_tiny)  # the server loads the same tiny model folder

    with ThreadPoolExecutor(n_requests) as pool:
        futures = [pool.submit(post_score, server.base_url, f"inflight-{i}") for i in range(n_requests)]
        wait_for_in_progress(server, n_requests)
        sigterm_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        # Readiness fails at once: /ready answers 503 until the listening socket closes, then connections fail.
        ready_answers = []
        for _ in range(50):
            try:
                ready_answers.append(httpx.get(f"{server.base_url}/ready", timeout=5).status_code)
            except httpx.TransportError:
                break
            time.sleep(0.01)
        else:
            pytest.fail(f"the server kept accepting connections after SIGTERM: {ready_answers}")
        assert all(status == 503 for status in ready_answers), ready_answers

        results = [future.result(timeout=120) for future in futures]

    exit_code = server.process.wait(timeout=60)
    # uvicorn re-raises the signal after its graceful shutdown: "terminated by SIGTERM" (older uvicorn: 0).
    assert exit_code in (-signal.SIGTERM, 0), exit_code

    for i, (answer, answered_at) in enumerate(results):
        assert not isinstance(answer, Exception), f"request {i} was lost: {answer!r}"
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-request-id"] == f"inflight-{i}"
        assert answered_at > sigterm_at  # it was still queued when the signal came
        data = answer.json()["data"]
        assert len(data) == len(expected)
        for got, want in zip(data, expected):
            assert got["label_logprobs"] == pytest.approx(want, abs=1e-4)

    entries = server.log_entries()
    messages = [e["message"] for e in entries]
    # Start-up lines: model, device, dtype and load time.
    loaded = next(m for m in messages if m.startswith("loaded "))
    assert " on cpu as float32 in " in loaded and " s (vocab " in loaded
    assert any(m.startswith("ready (warm-up") for m in messages)
    # The server's own order of events: the signal, then every in-flight request answered, then exit.
    signal_at = next(i for i, m in enumerate(messages) if m.startswith("received SIGTERM: readiness is now 503"))
    assert "request_id" not in entries[signal_at]
    access = {e["request_id"]: i for i, e in enumerate(entries) if e["logger"] == "genscore.access"
              and e.get("request_id", "").startswith("inflight-")}
    assert sorted(access) == sorted(f"inflight-{i}" for i in range(n_requests))
    assert all(i > signal_at for i in access.values()), "a request was answered before the signal"
    for i in access.values():
        assert entries[i]["http"]["status"] == 200 and entries[i]["http"]["route"] == "/score"
    assert max(access.values()) < next(i for i, m in enumerate(messages) if "Application shutdown complete" in m)


def test_drain_timeout_bounds_the_shutdown(serve):
    """A request that cannot finish within --drain-timeout-s is cut off; the process still exits."""
    # 120 s batching wait: the request cannot start before the 1 s drain timeout.
    server = serve("--max-wait-ms", "120000", "--max-batch-size", "64", "--drain-timeout-s", "1")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(post_score, server.base_url, "too-slow")
        wait_for_in_progress(server, 1)
        server.process.send_signal(signal.SIGTERM)
        exit_code = server.process.wait(timeout=60)  # far less than the 120 s the request would need
        answer, _ = future.result(timeout=60)
    assert exit_code in (-signal.SIGTERM, 0), exit_code
    # uvicorn cancelled it at the drain timeout; the client is told to retry (503), not left with a bare 500.
    assert not isinstance(answer, Exception), answer
    assert answer.status_code == 503 and answer.headers["x-request-id"] == "too-slow"
    assert answer.json()["error"]["type"] == "service_unavailable_error"
    messages = [e["message"] for e in server.log_entries()]
    assert any("timeout graceful shutdown exceeded" in m for m in messages), messages
    assert not any("Exception in ASGI application" in m for m in messages), messages


def test_draining_flips_readiness_but_serves_received_requests(tiny_loaded):
    """In-process: the instant SIGTERM is handled, /ready is 503, while a request that reaches a route is served."""
    app = create_app(tiny_settings(), loaded=tiny_loaded)
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None))
    with TestClient(app) as client:
        wait_ready(client)
        assert client.get("/ready").status_code == 200
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        assert server.should_exit
        ready = client.get("/ready")
        assert ready.status_code == 503 and "shutting down" in ready.json()["error"]["message"]
        assert client.get("/health").status_code == 200  # draining is not dead: no liveness restart
        assert client.post("/score", json=BODY).status_code == 200
