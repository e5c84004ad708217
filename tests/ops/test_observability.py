"""Request ids (X-Request-ID), the access log, and text/JSON log lines."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest
from fastapi.testclient import TestClient

from app.edge.observability import request_id_var
from app.logs import JsonFormatter, RequestIdFilter, TextFormatter, configure_logging
from app.main import create_app
from tests.api.conftest import tiny_settings
from tests.conftest import wait_ready

SCORE = {"query": "The quick brown fox", "label_token_ids": [1, 2]}


def make_client(tiny_loaded, **settings):
    return TestClient(create_app(tiny_settings(**settings), loaded=tiny_loaded))


@pytest.fixture(scope="module")
def client(tiny_loaded):
    with make_client(tiny_loaded) as test_client:
        wait_ready(test_client)
        yield test_client


def test_request_id_is_echoed_when_given(client):
    response = client.post("/score", json=SCORE, headers={"X-Request-ID": "req-42.a:b"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-42.a:b"


@pytest.mark.parametrize("given", [None, "has space", "x" * 129, "quote\"d", "new\u00e9line"])
def test_request_id_is_generated_when_absent_or_unsafe(client, given):
    headers = {} if given is None else {"X-Request-ID": given.encode("utf-8")}
    response = client.post("/score", json=SCORE, headers=headers)
    assert response.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])


def test_every_response_has_a_request_id(client):
    ids = set()
    for response in (
        client.post("/score", json={"query": "x", "label_token_ids": [10**9]}),  # 400 from the engine
        client.post("/score", content=b"{not json", headers={"content-type": "application/json"}),  # 400 parse
        client.get("/no/such/route"),  # 404
        client.get("/health"),
        client.get("/ready"),
        client.get("/metrics"),
        client.get("/v1/models"),
    ):
        ids.add(response.headers["x-request-id"])
    assert len(ids) == 7  # a fresh id each


def test_ready_503_has_a_request_id(tiny_loaded):
    with make_client(tiny_loaded) as loading:
        loading.app.state.lifecycle.start_draining()
        response = loading.get("/ready", headers={"X-Request-ID": "probe-1"})
        assert response.status_code == 503 and response.headers["x-request-id"] == "probe-1"


def test_access_log_line_per_request(client, caplog):
    with caplog.at_level(logging.DEBUG, logger="genscore.access"):
        client.post("/score", json=SCORE, headers={"X-Request-ID": "acc-1"})
        client.post("/score", json={"query": "x", "label_token_ids": [10**9]}, headers={"X-Request-ID": "acc-2"})
        client.get("/ready", headers={"X-Request-ID": "acc-3"})
    records = {r.request_id: r for r in caplog.records if r.name == "genscore.access"}
    ok, bad, probe = records["acc-1"], records["acc-2"], records["acc-3"]
    assert ok.levelno == logging.INFO and ok.http["status"] == 200 and ok.http["route"] == "/score"
    assert ok.http["method"] == "POST" and ok.http["path"] == "/score" and ok.http["duration_ms"] > 0
    assert '"POST /score HTTP/1.1" 200' in ok.getMessage()
    assert bad.levelno == logging.INFO and bad.http["status"] == 400
    assert probe.levelno == logging.DEBUG  # kubelet probes every few seconds would flood the log at INFO


def test_access_log_can_be_turned_off(tiny_loaded, caplog):
    with make_client(tiny_loaded, access_log=False) as quiet, caplog.at_level(logging.DEBUG, logger="genscore.access"):
        wait_ready(quiet)
        assert quiet.post("/score", json=SCORE).status_code == 200
    assert not [r for r in caplog.records if r.name == "genscore.access"]


def _formatted(formatter: logging.Formatter, emit) -> list[str]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(RequestIdFilter())
    logger = logging.getLogger("genscore.test-logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().splitlines()


def _emit(logger: logging.Logger) -> None:
    logger.info("outside %s", "requests")
    token = request_id_var.set("rid-7")
    try:
        logger.info("inside", extra={"http": {"status": 200, "route": "/score"}})
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        request_id_var.reset(token)


def test_json_log_lines():
    lines = [json.loads(line) for line in _formatted(JsonFormatter(), _emit) if line.startswith("{")]
    outside, inside, failed = lines
    assert outside["message"] == "outside requests" and outside["level"] == "info"
    assert outside["logger"] == "genscore.test-logs" and "request_id" not in outside
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", outside["time"])
    assert inside["request_id"] == "rid-7" and inside["http"] == {"status": 200, "route": "/score"}
    assert failed["level"] == "error" and "ValueError: boom" in failed["exception"]


def test_text_log_lines_carry_the_request_id():
    lines = _formatted(TextFormatter("%(levelname)s %(name)s: %(message)s"), _emit)
    assert lines[0] == "INFO genscore.test-logs: outside requests"
    assert lines[1] == "INFO genscore.test-logs: inside [request_id=rid-7]"


def test_configure_logging_json_covers_uvicorn(capsys):
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("info", "json")
        logging.getLogger("uvicorn.error").info("Uvicorn running")
        logging.getLogger("genscore").debug("hidden at info")
        err = capsys.readouterr().err.splitlines()
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    entries = [json.loads(line) for line in err]
    assert [e["message"] for e in entries] == ["Uvicorn running"]
    assert entries[0]["logger"] == "uvicorn.error"


PROBES = ("/ready", "/health", "/metrics")


def _kubelet_probe_loop(client, count: int = 60) -> list[int]:
    """A kubelet's startup/readiness/liveness probes and a Prometheus scrape, without the seconds between them."""
    return [client.get(PROBES[i % len(PROBES)], headers={"User-Agent": "kube-probe/1.37"}).status_code
            for i in range(count)]


_CLIENT_LOGGERS = ("httpx", "httpx2", "httpcore")  # the test client's own request lines


def _info_lines(caplog) -> list[str]:
    """The server's lines at INFO and above."""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.INFO and r.name.split(".")[0] not in _CLIENT_LOGGERS]


def test_probe_loop_adds_no_info_lines_while_real_requests_keep_theirs(client, caplog):
    with caplog.at_level(logging.INFO):
        statuses = _kubelet_probe_loop(client)
        assert set(statuses) == {200}
        assert _info_lines(caplog) == []
        assert client.post("/score", json=SCORE, headers={"X-Request-ID": "real-1"}).status_code == 200
    access = [r for r in caplog.records if r.name == "genscore.access"]
    assert [(r.levelno, r.request_id, r.http["route"]) for r in access] == [(logging.INFO, "real-1", "/score")]


def test_failing_probes_while_not_ready_add_no_info_lines(tiny_loaded, caplog):
    """The startup probe fails every few seconds while the model loads, readiness while draining: no INFO line each."""
    with make_client(tiny_loaded) as not_ready, caplog.at_level(logging.INFO):
        wait_ready(not_ready)
        caplog.clear()
        not_ready.app.state.lifecycle.start_draining()
        statuses = _kubelet_probe_loop(not_ready)
        assert 503 in statuses
        assert _info_lines(caplog) == []


def test_probe_lines_are_there_at_debug(client, caplog):
    with caplog.at_level(logging.DEBUG, logger="genscore.access"):
        _kubelet_probe_loop(client, count=3)
    lines = [r for r in caplog.records if r.name == "genscore.access"]
    assert [(r.levelno, r.http["route"]) for r in lines] == [(logging.DEBUG, p) for p in PROBES]


def test_failing_scrape_stays_at_info(tiny_loaded, caplog):
    """A scraper without the API key (with --no-public-metrics) is misconfigured, and nothing else says so."""
    with make_client(tiny_loaded, api_key="k", public_metrics=False) as locked, caplog.at_level(logging.INFO):
        wait_ready(locked)
        assert locked.get("/metrics").status_code == 401
    access = [r for r in caplog.records if r.name == "genscore.access"]
    assert [(r.levelno, r.http["status"]) for r in access] == [(logging.INFO, 401)]
