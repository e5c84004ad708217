"""Contract tests for the drop-in routes, from SGLang's and vLLM's own documented examples and tests:
POST /v1/score (SGLang) and POST /generative_scoring (vLLM)."""

from __future__ import annotations

import math

import pytest

from tests.api.conftest import TINY_NAME
from tests.reference import mode_values, position_logits

TOL = 1e-4


def logprobs(plain, ids: list[int]):
    """raw logprobs [V] after ids, from the plain transformers model."""
    return mode_values(position_logits(plain, ids)[-1], "raw_logprobs", {})


# --- SGLang: POST /v1/score --------------------------------------------------------------


def test_sglang_envelope(client):
    """SGLang's test_response_envelope: scores, model and object 'scoring'."""
    r = client.post("/v1/score", json={"query": "The capital of France is", "items": ["Paris", "Berlin"],
                                       "label_token_ids": [1, 2], "apply_softmax": True, "model": TINY_NAME})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"scores", "model", "usage", "object"}
    assert body["object"] == "scoring" and body["model"] == TINY_NAME
    assert len(body["scores"]) == 2 and all(len(row) == 2 for row in body["scores"])
    assert set(body["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"}
    assert body["usage"]["completion_tokens"] == 0


def test_sglang_text_prompts_are_joined_then_tokenized_and_softmax_is_off_by_default(client, tiny_loaded, plain_tiny):
    """SGLang builds f"{query}{item}" (f"{item}{query}" with item_first) and tokenizes it with special tokens."""
    query, items, labels = "The capital of France is", [" Paris", " Berlin", "Rome"], [5, 17, 100]
    for item_first in (False, True):
        body = client.post("/v1/score", json={"query": query, "items": items, "label_token_ids": labels,
                                              "item_first": item_first}).json()
        for item, row in zip(items, body["scores"]):
            text = item + query if item_first else query + item
            expected = logprobs(plain_tiny, tiny_loaded.tokenizer(text)["input_ids"])[labels].exp()
            assert row == pytest.approx(expected.tolist(), abs=TOL)
            assert abs(sum(row) - 1.0) > 1e-3  # model probabilities over a subset do not sum to 1


def test_sglang_apply_softmax_normalizes_each_item(client):
    body = client.post("/v1/score", json={"query": "The capital of France is", "items": ["Paris", "Berlin", "Rome"],
                                          "label_token_ids": [1, 2, 3], "apply_softmax": True}).json()
    for row in body["scores"]:
        assert sum(row) == pytest.approx(1.0, abs=1e-6) and all(v >= 0 for v in row)


def test_sglang_token_ids_are_concatenated(client, plain_tiny):
    query, items, labels = [1, 40, 50, 60], [[70, 80], [90]], [5, 6]
    for item_first in (False, True):
        body = client.post("/v1/score", json={"query": query, "items": items, "label_token_ids": labels,
                                              "item_first": item_first}).json()
        for item, row in zip(items, body["scores"]):
            ids = item + query if item_first else query + item
            assert row == pytest.approx(logprobs(plain_tiny, ids)[labels].exp().tolist(), abs=TOL)
        assert body["usage"]["prompt_tokens"] == sum(len(query) + len(i) for i in items)


def test_sglang_single_item_string_and_empty_items(client):
    one = client.post("/v1/score", json={"query": "Q", "items": "X", "label_token_ids": [1, 2]}).json()
    assert len(one["scores"]) == 1 and len(one["scores"][0]) == 2
    empty = client.post("/v1/score", json={"query": "Test query", "items": [], "label_token_ids": [1, 2]})
    assert empty.status_code == 200 and empty.json()["scores"] == []


@pytest.mark.parametrize("body, status, param", [
    ({"query": "Q", "items": ["X"], "label_token_ids": "bad"}, 400, "label_token_ids"),
    ({"query": "Q", "items": 42, "label_token_ids": [1, 2]}, 400, "items"),
    ({"query": "Q", "items": ["X"], "label_token_ids": [1, 10_000]}, 400, "label_token_ids"),
    ({"query": "Q", "items": [[1, 2]], "label_token_ids": [1]}, 400, "items"),
    ({"query": [1, 2], "items": ["X"], "label_token_ids": [1]}, 400, "items"),
    ({"query": "Q", "label_token_ids": [1]}, 400, "items"),
    ({"query": "Q", "items": ["X"], "label_token_ids": [1], "model": "other"}, 404, "model"),
])
def test_sglang_rejections(client, body, status, param):
    r = client.post("/v1/score", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


# --- vLLM: POST /generative_scoring ------------------------------------------------------


def test_vllm_documented_example(client, tiny_loaded, plain_tiny):
    """vLLM's docs example: the score is P(label 0) / (P(label 0) + P(label 1)), softmax on by default."""
    query, items, labels = "Is this city the capital of France?", ["Paris", "London", "Berlin"], [9, 27]
    r = client.post("/generative_scoring", json={"model": TINY_NAME, "query": query, "items": items,
                                                 "label_token_ids": labels})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"].startswith("generative-scoring-") and body["object"] == "list"
    assert body["model"] == TINY_NAME and isinstance(body["created"], int)
    assert [set(d) for d in body["data"]] == [{"index", "object", "score"}] * 3
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    q = tiny_loaded.tokenizer(query)["input_ids"]
    for item, entry in zip(items, body["data"]):
        p = logprobs(plain_tiny, q + tiny_loaded.tokenizer(item, add_special_tokens=False)["input_ids"])[labels].exp()
        assert entry["score"] == pytest.approx((p[0] / (p[0] + p[1])).item(), abs=TOL)
    usage = body["usage"]
    assert set(usage) == {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"}
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(
        len(q) + len(tiny_loaded.tokenizer(i, add_special_tokens=False)["input_ids"]) for i in items)


def test_vllm_without_softmax_the_score_is_the_model_probability(client, plain_tiny):
    query = [1, 40, 50]
    body = client.post("/generative_scoring", json={"query": query, "items": [[60], [70, 80]],
                                                    "label_token_ids": [5, 6], "apply_softmax": False,
                                                    "item_first": True, "add_special_tokens": False}).json()
    for item, entry in zip([[60], [70, 80]], body["data"]):
        assert entry["score"] == pytest.approx(math.exp(logprobs(plain_tiny, item + query)[5].item()), abs=TOL)


def test_vllm_request_ids(client):
    body = {"query": "Q", "items": ["X"], "label_token_ids": [1], "request_id": "abc", "priority": 3}
    assert client.post("/generative_scoring", json=body).json()["id"] == "generative-scoring-abc"
    r = client.post("/generative_scoring", json=body, headers={"X-Request-Id": "from-header"})
    assert r.json()["id"] == "generative-scoring-from-header"


@pytest.mark.parametrize("body, status, param", [
    ({"query": "Q", "items": ["X"], "label_token_ids": [10_000]}, 400, "label_token_ids"),
    ({"query": "Q", "items": ["X"], "label_token_ids": []}, 400, "label_token_ids"),
    ({"query": "Q", "items": [], "label_token_ids": [1]}, 400, "items"),
    ({"query": "Q", "items": "X", "label_token_ids": [1]}, 400, "items"),
    ({"query": "Q", "items": ["X"]}, 400, "label_token_ids"),
    ({"query": "Q", "items": ["X"], "label_token_ids": [1], "model": "other"}, 404, "model"),
])
def test_vllm_rejections(client, body, status, param):
    r = client.post("/generative_scoring", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
