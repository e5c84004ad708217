"""API key, CORS and logs: who may call, from which browser origins, and that request content stays out of the log."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient
from pydantic_settings import CliApp

from app.main import create_app
from app.settings import Settings
from tests.api.conftest import tiny_settings
from tests.conftest import wait_ready
from tests.reliability.conftest import POISON, score_body

KEY = "sk-genscore-test-0123456789"
GOOD = score_body([5, 6, 7])


@pytest.fixture(scope="module")
def app_with(tiny_loaded):
    clients = []

    def make(**settings) -> TestClient:
        client = TestClient(create_app(tiny_settings(**settings), loaded=tiny_loaded))
        client.__enter__()
        wait_ready(client)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def assert_401(response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert response.headers["www-authenticate"] == "Bearer"
    assert KEY not in response.text


@pytest.mark.parametrize("header", [None, "", f"Basic {KEY}", "Bearer", "Bearer wrong", f"Bearer {KEY}x",
                                    f"Bearer {KEY[:-1]}", f"bearer  {KEY[::-1]}"])
def test_wrong_or_missing_key_is_401(app_with, header):
    client = app_with(api_key=KEY)
    headers = {} if header is None else {"Authorization": header}
    assert_401(client.post("/score", json=GOOD, headers=headers))
    assert_401(client.get("/v1/models", headers=headers))
    assert_401(client.get("/nope", headers=headers))  # unknown routes too: no probing of what exists


def test_right_key_is_served_and_the_scheme_is_case_insensitive(app_with):
    client = app_with(api_key=KEY)
    assert client.post("/score", json=GOOD, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_probes_need_no_key_and_metrics_exemption_is_configurable(app_with):
    public = app_with(api_key=KEY)
    assert public.get("/health").status_code == 200 and public.get("/ready").status_code == 200
    # /metrics is served without a key when public, and is checked when not
    metrics = public.get("/metrics")
    assert metrics.status_code == 200 and "genscore_" in metrics.text, metrics.text[:200]
    private = app_with(api_key=KEY, public_metrics=False)
    assert_401(private.get("/metrics"))
    assert private.get("/health").status_code == 200


def test_no_key_configured_means_open(client):
    assert client.post("/score", json=GOOD).status_code == 200


def test_openapi_documents_401_only_with_a_key(app_with, client):
    responses = app_with(api_key=KEY).get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert "401" in responses["paths"]["/score"]["post"]["responses"]
    assert "401" not in client.get("/openapi.json").json()["paths"]["/score"]["post"]["responses"]


def test_api_key_from_flag_or_environment_is_secret(monkeypatch):
    from_flag = CliApp.run(Settings, cli_args=["--api-key", KEY])
    assert from_flag.api_key.get_secret_value() == KEY
    monkeypatch.setenv("GENSCORE_API_KEY", KEY)
    from_env = Settings()
    assert from_env.api_key.get_secret_value() == KEY
    assert KEY not in repr(from_env) and KEY not in str(from_env.model_dump())


def test_empty_api_key_is_refused_at_start():
    with pytest.raises(ValueError):
        Settings(api_key="")


def test_cors_is_off_unless_configured(client):
    preflight = client.options("/score", headers={"Origin": "https://evil.example",
                                                  "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    response = client.post("/score", json=GOOD, headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in response.headers


def test_cors_allows_only_configured_origins_and_answers_preflight_before_the_key_check(app_with):
    client = app_with(api_key=KEY, cors_allow_origins=["https://app.example"])
    preflight = client.options("/score", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    refused = client.post("/score", json=GOOD, headers={"Origin": "https://app.example"})
    assert_401(refused)
    assert refused.headers["access-control-allow-origin"] == "https://app.example"  # the browser may read the 401
    served = client.post("/score", json=GOOD, headers={"Origin": "https://app.example",
                                                       "Authorization": f"Bearer {KEY}"})
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == "https://app.example"
    other = client.post("/score", json=GOOD, headers={"Origin": "https://evil.example",
                                                      "Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in other.headers


def test_no_request_content_in_logs_at_the_default_level(app_with, probe, caplog):
    secret_text = "my-private-prompt-zq"
    client = app_with(api_key=KEY, max_body_bytes=4096)
    auth = {"Authorization": f"Bearer {KEY}"}
    probe.fault = lambda ids: RuntimeError("injected fault") if (ids == POISON).any() else None
    with caplog.at_level(logging.INFO):  # the server's default level
        assert client.post("/score", json={"query": secret_text, "label_token_ids": [5]},
                           headers=auth).status_code == 200
        assert client.post("/score", json={"query": secret_text, "label_token_ids": [10**6]},
                           headers=auth).status_code == 400
        assert client.post("/score", json={"query": secret_text, "items": [[POISON]], "label_token_ids": [5]},
                           headers=auth).status_code == 500
        assert client.post("/score", json={"query": secret_text * 400, "label_token_ids": [5]},
                           headers=auth).status_code == 413
        assert client.post("/score", json={"query": secret_text, "label_token_ids": [5]},
                           headers={"Authorization": f"Bearer {secret_text}"}).status_code == 401
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert "failed on its own" in logged  # the 500 was logged (with its cause) ...
    assert secret_text not in logged and KEY not in logged  # ... but no request content and no key
