"""Probes over the app's life: loading, warming up, ready, a failed load, a dead engine loop."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

import app.main as app_main
from app.main import create_app
from tests.api.conftest import tiny_settings
from tests.conftest import wait_ready


def test_ready_is_503_until_the_model_is_loaded(monkeypatch, tiny_loaded):
    gate = threading.Event()

    def slow_load(*args, **kwargs):
        gate.wait(10)
        return tiny_loaded

    monkeypatch.setattr(app_main, "load_model", slow_load)
    with TestClient(create_app(tiny_settings())) as client:
        assert client.get("/health").status_code == 200  # alive while loading: liveness must not kill a loading pod
        ready = client.get("/ready")
        assert ready.status_code == 503 and "loading" in ready.json()["error"]["message"]
        assert client.post("/score", json={"query": "x", "label_token_ids": [1]}).status_code == 503
        gate.set()
        wait_ready(client)
        assert client.post("/score", json={"query": "x", "label_token_ids": [1]}).status_code == 200


def test_failed_load_fails_liveness_and_reports(tmp_path):
    reasons: list[str] = []
    settings = tiny_settings().model_copy(update={"model": str(tmp_path / "missing.gguf")})
    with TestClient(create_app(settings, on_fatal=reasons.append)) as client:
        deadline = time.monotonic() + 10
        while not reasons and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reasons and "missing.gguf" in reasons[0]
        assert client.get("/health").status_code == 503
        assert client.get("/ready").status_code == 503


def test_dead_batcher_loop_fails_health(tiny_loaded):
    with TestClient(create_app(tiny_settings(), loaded=tiny_loaded)) as client:
        wait_ready(client)
        engine = client.app.state.lifecycle.engine
        client.portal.call(engine._task.cancel)  # as if a bug ended the loop
        deadline = time.monotonic() + 5
        while client.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        health = client.get("/health")
        assert health.status_code == 503 and "batcher" in health.json()["error"]["message"]
        assert client.post("/score", json={"query": "x", "label_token_ids": [1]}).status_code == 503
