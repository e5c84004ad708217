"""Batch invariance over HTTP (bfloat16, tiny Llama): /v1/models says whether numbers are batch-invariant, and with
--batch-invariant a /score answer is the same JSON alone, sent together with other requests, and on a prefix-cache hit."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from models import load_model
from tests.conftest import live_server

TARGET = {"query": [(7 * i + 3) % 200 for i in range(30)], "items": [[5, 9, 11], [40] * 12, [77, 3]],
          "label_token_ids": [5, 17, 120], "top_logprobs": 4}


def _others(seed: int) -> list[dict]:
    """Requests of random lengths, modes and item counts to send alongside the target."""
    rng = random.Random(seed)
    modes = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
    out = []
    for _ in range(rng.randint(3, 8)):
        body = {"query": [rng.randrange(200) for _ in range(rng.randint(1, 90))], "label_token_ids": [1, 2],
                "logprobs_mode": rng.choice(modes), "temperature": rng.choice([0.5, 1.0, 2.0]), "top_logprobs": 2}
        if rng.random() < 0.5:
            body["items"] = [[rng.randrange(200) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 5))]
        out.append(body)
    return out


def _data(client: httpx.Client, body: dict) -> list:
    response = client.post("/score", json=body)
    assert response.status_code == 200, response.text
    return response.json()["data"]


@pytest.fixture(scope="module")
def invariant_url(tiny_model_dirs):
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="bfloat16", cache_dir=None,
                        batch_invariant=True)
    # a long wait so that requests sent together share batches
    settings = Settings(model="unused", served_model_name="tiny", device="cpu", dtype="bfloat16", max_wait_ms=50,
                        batch_invariant=True)
    with live_server(create_app(settings, loaded=loaded)) as url:
        yield url


def test_models_route_says_the_numbers_are_batch_invariant(invariant_url, tiny_loaded):
    paths = httpx.get(f"{invariant_url}/v1/models").json()["data"][0]["fast_paths"]["paths"]
    assert {p["name"]: p["enabled"] for p in paths}["batch_invariant"] is True
    assert {c.name: c.enabled for c in tiny_loaded.plan.checks}["batch_invariant"] is False  # the default


@pytest.mark.parametrize("seed", range(3))
def test_a_score_is_the_same_alone_and_sent_with_others(invariant_url, seed):
    target = dict(TARGET, query=TARGET["query"][seed:])  # a new query per seed: its first run is a cache miss
    with httpx.Client(base_url=invariant_url, timeout=60) as client:
        alone = _data(client, target)
        bodies = _others(seed)
        at = random.Random(seed).randint(0, len(bodies))
        bodies.insert(at, target)
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(lambda body: _data(client, body), bodies))
        assert together[at] == alone  # with others, its query's states now a cache hit
        assert _data(client, target) == alone
