"""Multi-token candidates: each token's value equals a brute-force full forward of prompt + candidate, in every mode."""

from __future__ import annotations

import math

import pytest

from tests.reference import MODES, as_json, candidate_reference

TOL = 1e-4
QUERY = "Question: what color is the sky? Answer:"
ITEMS = ["", " It is", " The answer is"]
CANDIDATES = [" blue", " red green yellow", " blue.", " white black"]
PROCESSORS = {"temperature": 1.5, "top_k": 250, "logit_bias": {"7": 2.0}}


def tokens(loaded, text, special=True):
    return loaded.tokenizer(text, add_special_tokens=special)["input_ids"]


@pytest.mark.parametrize("mode", MODES)
def test_candidates_equal_brute_force(client, tiny_loaded, plain_tiny, mode):
    out = client.post("/score", json={"query": QUERY, "items": ITEMS, "candidates": CANDIDATES,
                                      "logprobs_mode": mode, **PROCESSORS})
    assert out.status_code == 200, out.text
    body = out.json()
    q = tokens(tiny_loaded, QUERY)
    cand_ids = [tokens(tiny_loaded, c, False) for c in CANDIDATES]
    assert any(len(c) > 1 for c in cand_ids)
    finite = 0
    for item, entry in zip(ITEMS, body["data"]):
        assert set(entry) == {"index", "candidate_logprobs", "scores", "candidate_token_logprobs",
                              "candidate_num_tokens"}
        prompt = q + tokens(tiny_loaded, item, False)
        assert entry["candidate_num_tokens"] == [len(c) for c in cand_ids]
        for ids, per_token, total in zip(cand_ids, entry["candidate_token_logprobs"], entry["candidate_logprobs"]):
            expected = candidate_reference(plain_tiny, prompt, ids, mode, PROCESSORS)
            assert per_token == pytest.approx(as_json(expected), abs=TOL)
            assert total == pytest.approx(as_json([math.fsum(expected)])[0], abs=TOL)
            finite += all(v != -9999.0 for v in per_token)
        if mode.endswith("logprobs"):
            assert entry["scores"] == pytest.approx([math.exp(v) for v in entry["candidate_logprobs"]], abs=1e-9)
        else:
            assert entry["scores"] is None
    assert finite, "every candidate was filtered: the processed modes tested nothing"
    # every prompt token once and every candidate token once per prompt
    prompt_tokens = sum(len(q) + len(tokens(tiny_loaded, i, False)) for i in ITEMS) + len(ITEMS) * sum(map(len, cand_ids))
    assert body["usage"]["prompt_tokens"] == prompt_tokens


def test_token_id_candidates_and_query_alone(client, tiny_loaded, plain_tiny):
    q = tokens(tiny_loaded, QUERY)
    cand_ids = [tokens(tiny_loaded, c, False) for c in CANDIDATES] + [[5], [5, 5, 5]]
    out = client.post("/score", json={"query": q, "candidates": cand_ids}).json()
    (entry,) = out["data"]
    for ids, per_token in zip(cand_ids, entry["candidate_token_logprobs"]):
        assert per_token == pytest.approx(candidate_reference(plain_tiny, q, ids, "raw_logprobs", {}), abs=TOL)
    by_text = client.post("/score", json={"query": QUERY, "candidates": CANDIDATES}).json()["data"][0]
    assert by_text["candidate_token_logprobs"] == entry["candidate_token_logprobs"][: len(CANDIDATES)]


def test_single_token_candidates_equal_labels(client, tiny_loaded):
    labels = [5, 17, 100]
    by_labels = client.post("/score", json={"query": QUERY, "items": ITEMS, "label_token_ids": labels}).json()
    by_candidates = client.post("/score", json={"query": QUERY, "items": ITEMS,
                                                "candidates": [[t] for t in labels]}).json()
    for a, b in zip(by_labels["data"], by_candidates["data"]):
        assert b["candidate_logprobs"] == pytest.approx(a["label_logprobs"], abs=1e-5)


def test_apply_softmax_normalizes_over_candidate_sums(client):
    out = client.post("/score", json={"query": QUERY, "candidates": CANDIDATES, "apply_softmax": True}).json()
    entry = out["data"][0]
    sums = entry["candidate_logprobs"]
    top = max(sums)
    expected = [math.exp(s - top) / sum(math.exp(t - top) for t in sums) for s in sums]
    assert entry["scores"] == pytest.approx(expected, rel=1e-9)
    assert sum(entry["scores"]) == pytest.approx(1.0)


@pytest.mark.parametrize("body, param", [
    ({"label_token_ids": [5], "candidates": [" blue"]}, "candidates"),
    ({"candidates": []}, "candidates"),
    ({"candidates": [""]}, "candidates[0]"),
    ({"candidates": [[5], []]}, "candidates[1]"),
    ({"candidates": [[5, 99_999]]}, "candidates[0]"),
    ({"candidates": [" blue"], "top_logprobs": 3}, "top_logprobs"),
    ({"candidates": [" blue", [5]]}, "candidates[1]"),
    ({"candidates": [" x"] * 257}, "candidates"),
    ({}, "label_token_ids"),
])
def test_bad_candidates_are_400_naming_the_field(client, body, param):
    r = client.post("/score", json={"query": QUERY, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_prompt_plus_candidate_longer_than_the_model_is_400(client, tiny_loaded):
    prompt = [5] * (tiny_loaded.max_length - 2)
    r = client.post("/score", json={"query": prompt, "candidates": [[5, 5, 5]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "query"
    assert client.post("/score", json={"query": prompt, "candidates": [[5, 5]]}).status_code == 200
