"""--compile reaches the model: the server loads with compiled layers, reports them in /v1/models and scores with them."""

from __future__ import annotations

import math

from fastapi.testclient import TestClient

from app.main import create_app
from tests.api.conftest import tiny_settings
from tests.conftest import wait_ready


def test_compile_setting_serves_with_compiled_layers(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    settings = tiny_settings(compile=True, cache_dir=tmp_path).model_copy(
        update={"model": str(tiny_model_dirs["llama"])})
    with TestClient(create_app(settings)) as client:
        wait_ready(client, timeout_s=300)
        paths = {p["name"]: p for p in client.get("/v1/models").json()["data"][0]["fast_paths"]["paths"]}
        assert paths["compiled_layers"]["enabled"], paths["compiled_layers"]
        body = {"query": "The quick brown fox", "items": [" jumps", " sleeps over"], "label_token_ids": [5, 6]}
        response = client.post("/score", json=body)
        assert response.status_code == 200, response.text
        values = [v for row in response.json()["data"] for v in row["label_logprobs"]]
        assert len(values) == 4 and all(math.isfinite(v) and v < 0 for v in values)
