"""POST /score on a tiny model: response shape, numbers against a plain forward pass, items, modes, softmax, truncation."""

from __future__ import annotations

import math

import pytest
import torch

from tests.api.conftest import TINY_NAME

PROMPT = "The quick brown fox"


def tokens(client_or_loaded, text, special=True):
    return client_or_loaded.tokenizer(text, add_special_tokens=special)["input_ids"]


def test_response_shape_field_by_field(client):
    body = {"query": PROMPT, "label_token_ids": [5, 6, 7], "top_logprobs": 2}
    r = client.post("/score", json=body)
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"id", "object", "created", "model", "logprobs_mode", "data", "usage"}
    assert out["id"].startswith("score-") and out["object"] == "score"
    assert isinstance(out["created"], int) and out["model"] == TINY_NAME
    assert out["logprobs_mode"] == "raw_logprobs"
    assert len(out["data"]) == 1
    entry = out["data"][0]
    assert set(entry) == {"index", "label_logprobs", "scores", "label_ranks", "top_logprobs"}
    assert entry["index"] == 0
    assert len(entry["label_logprobs"]) == len(entry["scores"]) == len(entry["label_ranks"]) == 3
    assert all(isinstance(rank, int) and rank >= 1 for rank in entry["label_ranks"])
    assert [set(t) for t in entry["top_logprobs"]] == [{"token_id", "token", "logprob"}] * 2
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > 0


def test_label_logprobs_match_plain_forward(client, tiny_loaded, full_logits):
    labels = [0, 5, 17, 100, tiny_loaded.vocab_size - 1]
    out = client.post("/score", json={"query": PROMPT, "label_token_ids": labels}).json()["data"][0]
    reference = torch.log_softmax(full_logits(tokens(tiny_loaded, PROMPT)), -1)
    assert out["label_logprobs"] == pytest.approx(reference[labels].tolist(), abs=1e-5)
    assert out["scores"] == pytest.approx(reference[labels].exp().tolist(), abs=1e-6)
    ranks = [(reference > reference[i]).sum().item() + 1 for i in labels]
    assert out["label_ranks"] == ranks


def test_items_are_appended_or_prepended(client, tiny_loaded, full_logits):
    items = [" jumps", " over the lazy dog"]
    labels = [3, 9]
    q = tokens(tiny_loaded, PROMPT)
    for item_first in (False, True):
        out = client.post("/score", json={"query": PROMPT, "items": items, "label_token_ids": labels,
                                          "item_first": item_first}).json()
        assert [d["index"] for d in out["data"]] == [0, 1]
        for item, entry in zip(items, out["data"]):
            i = tokens(tiny_loaded, item, special=False)
            ids = i + q if item_first else q + i
            reference = torch.log_softmax(full_logits(ids), -1)[labels]
            assert entry["label_logprobs"] == pytest.approx(reference.tolist(), abs=1e-5)
        assert out["usage"]["prompt_tokens"] == sum(len(q) + len(tokens(tiny_loaded, it, False)) for it in items)


def test_token_id_inputs_equal_text_inputs(client, tiny_loaded):
    items = [" jumps", " over"]
    by_text = client.post("/score", json={"query": PROMPT, "items": items, "label_token_ids": [4]}).json()
    by_ids = client.post("/score", json={
        "query": tokens(tiny_loaded, PROMPT),
        "items": [tokens(tiny_loaded, it, special=False) for it in items],
        "label_token_ids": [4]}).json()
    assert [d["label_logprobs"] for d in by_text["data"]] == [d["label_logprobs"] for d in by_ids["data"]]


def test_apply_softmax_normalizes_over_labels(client):
    labels = [5, 6, 7, 8]
    raw = client.post("/score", json={"query": PROMPT, "label_token_ids": labels}).json()["data"][0]
    soft = client.post("/score", json={"query": PROMPT, "label_token_ids": labels, "apply_softmax": True}).json()
    scores = soft["data"][0]["scores"]
    assert sum(scores) == pytest.approx(1.0, abs=1e-9)
    expected = [math.exp(v) / sum(math.exp(w) for w in raw["label_logprobs"]) for v in raw["label_logprobs"]]
    assert scores == pytest.approx(expected, rel=1e-6)


def test_logit_modes_return_logits_and_no_scores(client, full_logits, tiny_loaded):
    labels = [2, 30]
    out = client.post("/score", json={"query": PROMPT, "label_token_ids": labels,
                                      "logprobs_mode": "raw_logits"}).json()
    assert out["logprobs_mode"] == "raw_logits"
    entry = out["data"][0]
    assert entry["scores"] is None
    assert entry["label_logprobs"] == pytest.approx(full_logits(tokens(tiny_loaded, PROMPT))[labels].tolist(), abs=1e-5)
    soft = client.post("/score", json={"query": PROMPT, "label_token_ids": labels, "logprobs_mode": "raw_logits",
                                       "apply_softmax": True}).json()["data"][0]
    assert sum(soft["scores"]) == pytest.approx(1.0)


def test_processed_mode_filters_to_minus_9999(client, tiny_loaded, full_logits):
    reference = full_logits(tokens(tiny_loaded, PROMPT))
    order = torch.argsort(reference, descending=True).tolist()
    kept, dropped = order[0], order[-1]
    out = client.post("/score", json={"query": PROMPT, "label_token_ids": [kept, dropped], "top_k": 3,
                                      "temperature": 0.7, "logprobs_mode": "processed_logprobs",
                                      "top_logprobs": 5}).json()["data"][0]
    assert out["label_logprobs"][1] == -9999.0 and out["scores"][1] == 0.0
    top3 = torch.log_softmax(reference[order[:3]] / 0.7, -1)
    assert out["label_logprobs"][0] == pytest.approx(top3[0].item(), abs=1e-5)
    assert [t["token_id"] for t in out["top_logprobs"][:3]] == order[:3]
    assert all(t["logprob"] == -9999.0 for t in out["top_logprobs"][3:])


def test_label_values_equal_top_logprobs_entries(client):
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        out = client.post("/score", json={"query": PROMPT, "label_token_ids": list(range(0, 320, 7)),
                                          "top_logprobs": 20, "logprobs_mode": mode, "top_p": 0.8,
                                          "temperature": 1.3}).json()["data"][0]
        top = {t["token_id"]: t["logprob"] for t in out["top_logprobs"]}
        shared = [(v, top[i]) for i, v in zip(range(0, 320, 7), out["label_logprobs"]) if i in top]
        assert shared, mode
        assert all(a == b for a, b in shared), mode


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tiny_loaded):
    ids = tokens(tiny_loaded, "Paris is the capital of France. Berlin is the capital of")
    truncated = client.post("/score", json={"query": ids, "label_token_ids": [5], "truncate_prompt_tokens": 4}).json()
    tail = client.post("/score", json={"query": ids[-4:], "label_token_ids": [5]}).json()
    assert truncated["data"][0]["label_logprobs"] == tail["data"][0]["label_logprobs"]
    assert truncated["usage"]["prompt_tokens"] == 4


def test_prompt_longer_than_the_model_is_rejected_unless_truncated(client, tiny_loaded):
    too_long = [5] * (tiny_loaded.max_length + 1)
    r = client.post("/score", json={"query": too_long, "label_token_ids": [5]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "query"
    r = client.post("/score", json={"query": too_long, "label_token_ids": [5], "truncate_prompt_tokens": 16})
    assert r.status_code == 200


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_other_architectures_score_like_their_plain_forward(arch, tiny_model_dirs, plain_models):
    from fastapi.testclient import TestClient

    from app.main import create_app
    from models import load_model
    from tests.api.conftest import tiny_settings
    from tests.conftest import wait_ready

    loaded = load_model(str(tiny_model_dirs[arch]), device="cpu", dtype="float32")
    items = [" a", " longer item here"]
    with TestClient(create_app(tiny_settings(), loaded=loaded)) as client:
        wait_ready(client)
        out = client.post("/score", json={"query": PROMPT, "items": items, "label_token_ids": [1, 50]}).json()
    q = tokens(loaded, PROMPT)
    for item, entry in zip(items, out["data"]):
        with torch.inference_mode():
            logits = plain_models[arch](torch.tensor([q + tokens(loaded, item, False)])).logits[0, -1].float()
        assert entry["label_logprobs"] == pytest.approx(torch.log_softmax(logits, -1)[[1, 50]].tolist(), abs=1e-5)


def test_models_lists_the_served_model(client, tiny_loaded):
    out = client.get("/v1/models").json()
    assert out["object"] == "list"
    assert out["data"][0]["id"] == TINY_NAME and out["data"][0]["max_model_len"] == tiny_loaded.max_length
    # the plan's decisions as the load made them, the kernels included
    card, plan = out["data"][0]["fast_paths"], tiny_loaded.plan
    assert (card["layout"], card["decoding"]) == (plan.layout, plan.decoding)
    assert (card["attention_kernel"], card["decode_kernel"]) == (plan.attention_kernel, plan.decode_kernel)
    assert (card["prefix_attention"], card["cuda_graph_buckets"]) == (plan.prefix_attention, [])
