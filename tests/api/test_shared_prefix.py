"""Items batched over the query's shared key/value states give the numbers of scoring each query + item from scratch."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from models import load_model
from tests.api.conftest import tiny_settings
from tests.conftest import wait_ready
from tests.reference import MODES, as_json, mode_values, position_logits

TOL = 1e-4
QUERY = "Is this review positive or negative? The movie was great."
# different lengths, one empty (the prompt is the query alone) and one sharing the query's next token
ITEMS = [" Answer:", "", " Answer: yes no", " The", " quick brown fox jumps over the lazy dog. Answer:"]
PROCESSORS = {"temperature": 1.5, "top_k": 250, "min_p": 0.001, "logit_bias": {"7": 2.0}}
LABELS = [0, 5, 17, 100, 300]


def tokens(loaded, text, special=True):
    return loaded.tokenizer(text, add_special_tokens=special)["input_ids"]


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def arch_client(request, tiny_model_dirs, tiny_loaded, plain_models):
    """(client, served model, plain reference model) for one architecture."""
    loaded = tiny_loaded if request.param == "llama" else load_model(str(tiny_model_dirs[request.param]), "cpu",
                                                                     "float32")
    with TestClient(create_app(tiny_settings(max_batch_size=3), loaded=loaded)) as client:
        wait_ready(client)
        assert client.app.state.lifecycle.engine.share_prefixes
        yield client, loaded, plain_models[request.param]


@pytest.mark.parametrize("mode", MODES)
def test_items_over_a_shared_prefix_equal_scoring_from_scratch(arch_client, mode):
    client, loaded, plain = arch_client
    body = {"query": QUERY, "items": ITEMS, "label_token_ids": LABELS, "logprobs_mode": mode, "top_logprobs": 5,
            **PROCESSORS}
    out = client.post("/score", json=body)
    assert out.status_code == 200, out.text
    data = out.json()["data"]
    q = tokens(loaded, QUERY)
    for item, entry in zip(ITEMS, data):
        expected = mode_values(position_logits(plain, q + tokens(loaded, item, False))[-1], mode, PROCESSORS)
        assert entry["label_logprobs"] == pytest.approx(as_json(expected[LABELS]), abs=TOL)
        top = [t["logprob"] for t in entry["top_logprobs"]]
        assert top == pytest.approx(as_json(expected.topk(5).values), abs=TOL)


def test_cached_tokens_count_the_shared_query(arch_client):
    client, loaded, plain = arch_client
    engine = client.app.state.lifecycle.engine
    engine.prefix_cache.clear()
    query = QUERY + " Once more."
    q = len(tokens(loaded, query))
    out = client.post("/score", json={"query": query, "items": ITEMS, "label_token_ids": LABELS}).json()
    # 5 items in batches of 3: the first item computes the query, every other one reuses it
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": q * (len(ITEMS) - 1)}
    again = client.post("/score", json={"query": query, "items": ITEMS, "label_token_ids": LABELS}).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": q * len(ITEMS)}
    # computed and reused states alike give the numbers of each full sequence from scratch, on the plain model
    ids = tokens(loaded, query)
    for response in (out, again):
        for item, entry in zip(ITEMS, response["data"]):
            expected = mode_values(position_logits(plain, ids + tokens(loaded, item, False))[-1], "raw_logprobs", {})
            assert entry["label_logprobs"] == pytest.approx(as_json(expected[LABELS]), abs=TOL)


def test_prefix_cache_and_sharing_off_give_the_same_numbers(tiny_loaded):
    """Three servers: sharing with the LRU cache, sharing without it, and no sharing at all."""
    body = {"query": QUERY, "items": ITEMS * 3, "label_token_ids": LABELS, "logprobs_mode": "processed_logprobs",
            **PROCESSORS}
    results = {}
    for name, settings in {
        "cache": tiny_settings(max_batch_size=4),
        "no-cache": tiny_settings(max_batch_size=4, prefix_cache_mb=0),
        "no-sharing": tiny_settings(max_batch_size=4, share_prefixes=False),
    }.items():
        with TestClient(create_app(settings, loaded=tiny_loaded)) as client:
            wait_ready(client)
            first = client.post("/score", json=body).json()
            second = client.post("/score", json=body).json()
            stats = client.app.state.lifecycle.engine.prefix_cache.stats
            results[name] = (first, second, stats.hits, stats.misses)
    with_cache, without_cache, unshared = results["cache"], results["no-cache"], results["no-sharing"]
    q = len(tokens(tiny_loaded, QUERY))
    n = len(ITEMS) * 3
    # with the cache, 15 items in 4 batches compute the query once; the second request computes nothing
    assert with_cache[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == q * (n - 1)
    assert with_cache[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == q * n
    assert with_cache[2] == 7 and with_cache[3] == 1  # 4 + 4 batches, one miss
    # without the cache, each of the 4 batches computes the query once
    assert without_cache[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == q * (n - 4)
    assert unshared[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reference = [d["label_logprobs"] for d in unshared[0]["data"]]
    for out in (with_cache[0], with_cache[1], without_cache[0], without_cache[1], unshared[1]):
        for got, want in zip([d["label_logprobs"] for d in out["data"]], reference):
            assert got == pytest.approx(want, abs=TOL)
    # the cache hands back the very states it stored: the first batch of the first request computed the query
    # (the one miss), the same batch of the second request read it from the cache (a hit), bit for bit the same
    assert [d["label_logprobs"] for d in with_cache[0]["data"][:4]] == \
        [d["label_logprobs"] for d in with_cache[1]["data"][:4]]


def test_item_first_and_truncation_share_what_is_common(client, tiny_loaded, plain_tiny):
    """item_first puts the query last, so only a common start of the items is shared; truncation cuts the query."""
    items = [" The movie was", " The movie was not", " The"]
    for extra in ({"item_first": True}, {"truncate_prompt_tokens": 6}):
        out = client.post("/score", json={"query": QUERY, "items": items, "label_token_ids": LABELS, **extra}).json()
        q = tokens(tiny_loaded, QUERY)
        for item, entry in zip(items, out["data"]):
            i = tokens(tiny_loaded, item, False)
            ids = i + q if extra.get("item_first") else (q + i)[-6:]
            expected = mode_values(position_logits(plain_tiny, ids)[-1], "raw_logprobs", {})
            assert entry["label_logprobs"] == pytest.approx(as_json(expected[LABELS]), abs=TOL)


def test_metrics_report_the_prefix_cache_and_cached_tokens(client, tiny_loaded):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, float]:
        text = client.get("/metrics").text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    query = QUERY + " Metrics."
    body = {"query": query, "items": ITEMS, "label_token_ids": LABELS}
    first = client.post("/score", json=body).json()
    second = client.post("/v1/score", json={"query": tokens(tiny_loaded, query), "items": [
        tokens(tiny_loaded, item, False) for item in ITEMS], "label_token_ids": LABELS}).json()
    after = scrape()
    assert after["genscore_prefix_cache_misses_total"] == before["genscore_prefix_cache_misses_total"] + 1
    assert after["genscore_prefix_cache_hits_total"] > before["genscore_prefix_cache_hits_total"]
    assert after["genscore_prefix_cache_entries"] >= 1 and after["genscore_prefix_cache_bytes"] > 0
    cached = first["usage"]["prompt_tokens_details"]["cached_tokens"] + \
        second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert after["genscore_prompt_tokens_cached_total"] - before["genscore_prompt_tokens_cached_total"] == cached


def test_a_small_prefix_cache_evicts_and_still_gives_the_plain_numbers(tiny_loaded, plain_tiny):
    """--prefix-cache-mb sized for one query's states, over real HTTP: a second query evicts the first, the first
    computes again, and every answer is the plain model's, whatever the cache held."""
    import httpx

    from tests.conftest import live_server

    first = tokens(tiny_loaded, QUERY)
    queries = [first, first[:-1] + [first[-1] + 1]]  # the same length, so the same state size
    items = [tokens(tiny_loaded, item, False) for item in ITEMS]
    with TestClient(create_app(tiny_settings(), loaded=tiny_loaded)) as sizing:
        wait_ready(sizing)
        body = {"query": queries[0], "items": items, "label_token_ids": LABELS}
        assert sizing.post("/score", json=body).status_code == 200
        state_bytes = sizing.app.state.lifecycle.engine.prefix_cache.stats.bytes
    assert state_bytes > 0
    app = create_app(tiny_settings(prefix_cache_mb=1.5 * state_bytes / 2**20), loaded=tiny_loaded)
    with live_server(app) as base_url:
        stats = app.state.lifecycle.engine.prefix_cache.stats
        answers = []
        for query in (queries[0], queries[1], queries[0], queries[0]):
            response = httpx.post(f"{base_url}/score", timeout=30,
                                  json={"query": query, "items": items, "label_token_ids": LABELS})
            assert response.status_code == 200, response.text
            answers.append((query, response.json()))
            assert stats.bytes <= stats.capacity_bytes and stats.entries == 1
        metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
    # A misses, B misses and evicts A, A misses and evicts B, A hits
    assert (stats.misses, stats.hits, stats.evictions) == (3, 1, 2)
    assert "genscore_prefix_cache_evictions_total 2.0" in metrics
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for _, a in answers]
    q = len(first)
    assert cached == [q * (len(ITEMS) - 1)] * 3 + [q * len(ITEMS)]
    for query, answer in answers:
        for item, entry in zip(items, answer["data"]):
            ids = query + item
            expected = mode_values(position_logits(plain_tiny, ids)[-1], "raw_logprobs", {})
            assert entry["label_logprobs"] == pytest.approx(as_json(expected[LABELS]), abs=TOL)


def test_a_new_query_runs_in_the_same_model_call_as_its_items(tiny_loaded, plain_tiny):
    """A query not in the prefix cache is computed in the very call that runs its items (one call, not a prefill
    and then the items), and still lands in the cache: the next request reuses it."""
    calls = []
    hook = tiny_loaded.model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    body = {"query": QUERY, "items": ITEMS, "label_token_ids": LABELS}
    try:
        with TestClient(create_app(tiny_settings(max_batch_size=8), loaded=tiny_loaded)) as client:
            wait_ready(client)
            calls.clear()  # warm-up's
            first = client.post("/score", json=body).json()
            assert len(calls) == 1, calls
            second = client.post("/score", json=body).json()
            assert client.app.state.lifecycle.engine.prefix_cache.stats.hits == 1
    finally:
        hook.remove()
    q = len(tokens(tiny_loaded, QUERY))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == q * len(ITEMS)
    for out in (first, second):
        for item, data in zip(ITEMS, out["data"]):
            expected = position_logits(plain_tiny, tokens(tiny_loaded, QUERY) + tokens(tiny_loaded, item, False))[-1]
            assert data["label_logprobs"] == pytest.approx(expected.log_softmax(-1)[LABELS].tolist(), abs=TOL)
