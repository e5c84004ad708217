"""Graceful shutdown: SIGTERM to a real `genscore serve` process with requests in flight; none is lost.

The server runs a tiny random model on 127.0.0.1 with a gate in its forward pass (tests/ops/gated_serve.py): the
test holds a forward pass (or a generation step) at the gate, lets more work queue behind it, sends SIGTERM, and only
then opens the gate, so the signal lands with work running and waiting by construction, not by timing.
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
from tests.conftest import free_port, json_log_entries, share_kernels, wait_ready
from tests.gates import wait_until
from tests.reference import greedy_reference

BODY = {"query": "Paris is the capital of", "items": [" France", " Germany"], "label_token_ids": [1, 2, 3],
        "top_logprobs": 2}


GATED_SERVE = Path(__file__).with_name("gated_serve.py")


class ServerProcess:
    """`genscore serve` in a subprocess on 127.0.0.1, JSON logs to a file, a gate in its forward pass (see the module
    docstring); always killed on exit."""

    def __init__(self, model_dir: Path, workdir: Path, *flags: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        self.gate = workdir / "gate"
        self.gate.mkdir()
        command = [sys.executable, str(GATED_SERVE), "serve", "--model", str(model_dir), "--host", "127.0.0.1",
                   "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
                   "--cache-dir", str(workdir / "cache"), "--log-format", "json", "--torch-threads", "1", *flags]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GENSCORE_")}
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TEST_GATE_DIR=str(self.gate))
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

    def hold(self) -> None:
        """From now on every forward pass waits at the gate until release()."""
        (self.gate / "armed").touch()

    def wait_held(self, timeout_s: float = 60.0) -> None:
        wait_until(lambda: (self.gate / "entered").exists(), timeout_s, "a forward pass to reach the gate")

    def release(self) -> None:
        (self.gate / "open").touch()

    def in_progress(self) -> float:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        family = next(f for f in text_string_to_metric_families(text) if f.name == "genscore_http_requests_in_progress")
        return family.samples[0].value

    def log_entries(self) -> list[dict]:
        return json_log_entries(self.log_path.read_text())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._log.close()


@pytest.fixture
def serve(tiny_model_dirs, tmp_path, built_kernels):
    started: list[ServerProcess] = []
    share_kernels(tmp_path / "cache", built_kernels)

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
    wait_until(lambda: server.in_progress() >= count + 1, 60, f"{count} requests to reach the server")


def assert_readiness_fails_then_the_socket_closes(server: ServerProcess) -> None:
    """After SIGTERM, /ready answers 503 until the listening socket closes, then connections fail."""
    ready_answers = []

    def closed() -> bool:
        try:
            ready_answers.append(httpx.get(f"{server.base_url}/ready", timeout=5).status_code)
        except httpx.TransportError:
            return True
        return False

    wait_until(closed, 30, "the server to stop accepting connections after SIGTERM")
    assert all(status == 503 for status in ready_answers), ready_answers


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
    """One request's forward pass is running and five more wait in the batcher when SIGTERM arrives."""
    n_requests = 6
    server = serve("--max-batch-size", "64", "--drain-timeout-s", "60")
    expected = reference_logprobs(tiny_loaded.tokenizer, plain_tiny)  # the server loads the same tiny model folder

    with ThreadPoolExecutor(n_requests) as pool:
        server.hold()
        futures = [pool.submit(post_score, server.base_url, "inflight-0")]
        server.wait_held()  # inflight-0's forward pass is running, held at the gate
        futures += [pool.submit(post_score, server.base_url, f"inflight-{i}") for i in range(1, n_requests)]
        wait_for_in_progress(server, n_requests)  # the other five are queued behind it
        sigterm_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert_readiness_fails_then_the_socket_closes(server)
        assert not any(f.done() for f in futures), "a request was answered while the model was held"
        server.release()
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
    server = serve("--max-batch-size", "64", "--drain-timeout-s", "1")
    with ThreadPoolExecutor(1) as pool:
        server.hold()  # the request's forward pass cannot end before the 1 s drain timeout
        future = pool.submit(post_score, server.base_url, "too-slow")
        server.wait_held()
        server.process.send_signal(signal.SIGTERM)
        answer, _ = future.result(timeout=60)  # cut off while its forward pass is still held
        server.release()  # the worker thread may end now, and with it the process
        exit_code = server.process.wait(timeout=60)
    assert exit_code in (-signal.SIGTERM, 0), exit_code
    # uvicorn cancelled it at the drain timeout; the client is told to retry (503), not left with a bare 500.
    assert not isinstance(answer, Exception), answer
    assert answer.status_code == 503 and answer.headers["x-request-id"] == "too-slow"
    assert answer.json()["error"]["type"] == "service_unavailable_error"
    messages = [e["message"] for e in server.log_entries()]
    assert any("timeout graceful shutdown exceeded" in m for m in messages), messages
    assert not any("Exception in ASGI application" in m for m in messages), messages


def test_sigterm_finishes_a_streaming_generation_in_flight(serve, tiny_loaded, plain_tiny):
    """A streamed completion whose generation step is running when SIGTERM arrives gets every token and [DONE]."""
    server = serve("--drain-timeout-s", "60")
    prompt, max_tokens = "The quick brown fox", 12
    ids = tiny_loaded.tokenizer(prompt)["input_ids"]
    expected = greedy_reference(plain_tiny, ids, max_tokens, tiny_loaded.pad_token_id)
    eos = tiny_loaded.tokenizer.eos_token_id
    if eos in expected:  # the server stops at the end-of-sequence token too
        expected = expected[:expected.index(eos) + 1]
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0, "stream": True}

    def stream() -> list[str]:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120,
                          headers={"X-Request-ID": "streaming"}) as response:
            assert response.status_code == 200
            return [line for line in response.iter_lines() if line]

    with ThreadPoolExecutor(1) as pool:
        server.hold()
        future = pool.submit(stream)
        server.wait_held()  # its first step (prefill and decode) is running, held at the gate
        server.process.send_signal(signal.SIGTERM)
        assert_readiness_fails_then_the_socket_closes(server)
        server.release()
        lines = future.result(timeout=120)
    assert server.process.wait(timeout=60) in (-signal.SIGTERM, 0)
    assert lines[-1] == "data: [DONE]", lines
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == [tiny_loaded.tokenizer.decode([t]) for t in expected]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


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
