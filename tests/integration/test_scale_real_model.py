"""The real default model: items over a shared prefix and multi-token candidates agree with a plain float32
transformers computation of each full sequence within 1e-4, in every logprobs mode; the drop-in routes too."""

from __future__ import annotations

import math

import pytest

from tests.reference import MODES, as_json, candidate_reference, mode_values, position_logits

TOL = 1e-4
QUERY = "Is the following review positive or negative? Review: the film was a delight from start to finish. Answer:"
ITEMS = [" positive", "", " It was", " I think the answer is", " The review is clearly"]
CANDIDATES = [" positive", " negative", " very positive", " mixed feelings"]
PROCESSORS = {"temperature": 0.7, "min_p": 0.02, "top_k": 40, "top_p": 0.9, "logit_bias": {"6199": 1.5}}


def tokens(tokenizer, text, special=True):
    return tokenizer(text, add_special_tokens=special)["input_ids"]


@pytest.mark.parametrize("mode", MODES)
def test_shared_prefix_items_match_float32_transformers(real_client, real_loaded, reference_model, mode):
    tokenizer = real_loaded.tokenizer
    labels = [tokens(tokenizer, w, False)[0] for w in (" positive", " negative", " yes", " no")] + [0, 6199, 49151]
    response = real_client.post("/score", json={"query": QUERY, "items": ITEMS, "label_token_ids": labels,
                                                "logprobs_mode": mode, "top_logprobs": 5, **PROCESSORS})
    assert response.status_code == 200, response.text
    body = response.json()
    q = tokens(tokenizer, QUERY)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(q) * (len(ITEMS) - 1)
    for item, entry in zip(ITEMS, body["data"]):
        expected = mode_values(position_logits(reference_model, q + tokens(tokenizer, item, False))[-1], mode,
                               PROCESSORS)
        assert entry["label_logprobs"] == pytest.approx(as_json(expected[labels]), abs=TOL)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(as_json(expected.topk(5).values),
                                                                               abs=TOL)


@pytest.mark.parametrize("mode", MODES)
def test_candidates_match_brute_force_float32_transformers(real_client, real_loaded, reference_model, mode):
    tokenizer = real_loaded.tokenizer
    items = ITEMS[:3]
    response = real_client.post("/score", json={"query": QUERY, "items": items, "candidates": CANDIDATES,
                                                "logprobs_mode": mode, **PROCESSORS})
    assert response.status_code == 200, response.text
    q = tokens(tokenizer, QUERY)
    cand_ids = [tokens(tokenizer, c, False) for c in CANDIDATES]
    assert max(map(len, cand_ids)) > 1
    for item, entry in zip(items, response.json()["data"]):
        prompt = q + tokens(tokenizer, item, False)
        for ids, per_token, total in zip(cand_ids, entry["candidate_token_logprobs"], entry["candidate_logprobs"]):
            expected = candidate_reference(reference_model, prompt, ids, mode, PROCESSORS)
            assert per_token == pytest.approx(as_json(expected), abs=TOL)
            assert total == pytest.approx(as_json([math.fsum(expected)])[0], abs=TOL)


def test_dropin_routes_match_float32_transformers(real_client, real_loaded, reference_model):
    tokenizer = real_loaded.tokenizer
    query, items = "Is this city the capital of France?", [" Paris", " London", " Berlin"]
    yes, no = tokens(tokenizer, " Yes", False)[0], tokens(tokenizer, " No", False)[0]
    sglang = real_client.post("/v1/score", json={"query": query, "items": items, "label_token_ids": [yes, no]}).json()
    vllm = real_client.post("/generative_scoring", json={"query": query, "items": items,
                                                        "label_token_ids": [yes, no]}).json()
    for item, row, entry in zip(items, sglang["scores"], vllm["data"]):
        joined = mode_values(position_logits(reference_model, tokens(tokenizer, query + item))[-1], "raw_logprobs", {})
        assert row == pytest.approx(joined[[yes, no]].exp().tolist(), abs=TOL)
        apart = mode_values(position_logits(reference_model, tokens(tokenizer, query) + tokens(tokenizer, item, False))
                            [-1], "raw_logprobs", {})
        p_yes, p_no = apart[yes].exp().item(), apart[no].exp().item()
        assert entry["score"] == pytest.approx(p_yes / (p_yes + p_no), abs=TOL)


def test_prompts_packed_across_the_pack_boundary_match_float32_transformers(real_client, real_loaded,
                                                                          reference_model, monkeypatch):
    """One batch of from-scratch prompts (item_first: nothing shared) holding over 1024 tokens, so the forward pass
    packs them into several rows of up to 1024 tokens (models/forward.py), on the real model: each prompt's numbers
    are still its own plain float32 pass."""
    import models.forward

    tokenizer = real_loaded.tokenizer
    query = " Is the review above positive or negative? Answer:"
    sentence = "the film was slow at first but the actors carried every scene with warmth and wit"
    openers = "Honestly Frankly Overall Sadly Luckily Clearly Oddly Surely Truly Mostly Really Simply Finally".split()
    # distinct first words: no start is common to all the prompts, so nothing is shared and every prompt packs
    items = [f"{word}, " + " ".join([sentence] * (4 + i % 3)) for i, word in enumerate(openers)]
    labels = [tokens(tokenizer, w, False)[0] for w in (" positive", " negative")]
    packs: list[list[list[int]]] = []
    plan = models.forward.plan_packs
    monkeypatch.setattr(models.forward, "plan_packs", lambda lengths, *a: packs.append(plan(lengths, *a)) or packs[-1])
    response = real_client.post("/score", json={"query": query, "items": items, "label_token_ids": labels,
                                                "item_first": True, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 1024
    assert any(len(p) > 1 for p in packs), f"the prompts were not split over several packs: {packs}"
    q = tokens(tokenizer, query, False)
    for item, entry in zip(items, response.json()["data"]):
        expected = mode_values(position_logits(reference_model, tokens(tokenizer, item, False) + q)[-1],
                               "raw_logprobs", {})
        assert entry["label_logprobs"] == pytest.approx(as_json(expected[labels]), abs=TOL)
