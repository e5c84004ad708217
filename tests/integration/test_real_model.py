"""The real default model (SmolLM2-135M): /score agrees with a plain float32 transformers computation within 1e-4,
in every logprobs mode, with and without items, alone and batched."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

TOL = 1e-4
QUERY = "Is the following review positive or negative? Review: the film was a delight from start to finish. Answer:"
ITEMS = [" positive", " negative", " It was", " I think the answer is"]
MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
PROCESSORS = {"temperature": 0.7, "min_p": 0.02, "top_k": 40, "top_p": 0.9, "logit_bias": {"6199": 1.5}}


def label_ids(tokenizer) -> list[int]:
    ids = [tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in (" positive", " negative", " yes", " no")]
    return ids + [0, 6199, 49151]


def reference_values(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """The definitions of DESIGN.md, written with transformers' own warpers in the order
    logit_bias, temperature, min_p, top_k, top_p."""
    x = logits.clone()[None]  # [1, V]
    if mode.startswith("processed"):
        x[0, 6199] += 1.5
        warpers = LogitsProcessorList([
            TemperatureLogitsWarper(0.7), MinPLogitsWarper(0.02), TopKLogitsWarper(40), TopPLogitsWarper(0.9)])
        x = warpers(torch.zeros((1, 1), dtype=torch.long), x)
    return torch.log_softmax(x, -1)[0] if mode.endswith("logprobs") else x[0]


def as_json(values: torch.Tensor) -> list[float]:
    return [-9999.0 if v == float("-inf") else v for v in values.tolist()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_items", [False, True], ids=["query", "items"])
def test_label_logprobs_match_float32_transformers(real_client, real_loaded, reference_logits, mode, with_items):
    tokenizer = real_loaded.tokenizer
    labels = label_ids(tokenizer)
    body = {"query": QUERY, "label_token_ids": labels, "logprobs_mode": mode, "top_logprobs": 5, **PROCESSORS}
    if with_items:
        body["items"] = ITEMS
    response = real_client.post("/score", json=body)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    query_ids = tokenizer(QUERY)["input_ids"]
    prompts = [query_ids + tokenizer(item, add_special_tokens=False)["input_ids"] for item in ITEMS] if with_items \
        else [query_ids]
    assert len(data) == len(prompts)
    for prompt, entry in zip(prompts, data):
        expected = reference_values(reference_logits(prompt), mode)
        assert entry["label_logprobs"] == pytest.approx(as_json(expected[labels]), abs=TOL)
        finite_top = [t["token_id"] for t in entry["top_logprobs"] if t["logprob"] != -9999.0]
        # among filtered (-inf) tokens the order is a tie, so only the finite part has one right order
        assert finite_top == torch.topk(expected, 5).indices.tolist()[: len(finite_top)]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(as_json(torch.topk(expected, 5).values),
                                                                            abs=TOL)


def test_same_numbers_alone_and_in_a_mixed_batch(real_client, real_loaded):
    """Requests of different lengths and settings, sent concurrently through a live HTTP server."""
    from app.main import create_app
    from app.settings import Settings
    from tests.conftest import live_server
    from tests.gates import BatchGate, async_wait_until

    labels = label_ids(real_loaded.tokenizer)
    requests = []
    for i, mode in enumerate(MODES * 2):
        body = {"query": QUERY[: 20 + 11 * i], "label_token_ids": labels[: 2 + i % 5], "logprobs_mode": mode}
        if i % 2:
            body.update(PROCESSORS)
        if i % 3 == 0:
            body["items"] = ITEMS[: 1 + i % 4]
        requests.append(body)
    alone = [real_client.post("/score", json=b).json() for b in requests]
    units = sum(len(b.get("items") or [None]) for b in requests)
    app = create_app(Settings(model="smollm2-135m", device="cpu", dtype="float32"), loaded=real_loaded)
    with live_server(app) as base_url:
        batcher = app.state.lifecycle.engine.batcher
        gate = BatchGate(batcher)

        async def burst():
            # hold the worker on one request, queue the whole burst behind it, then let it go: one mixed batch
            async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
                gate.hold()
                held = asyncio.create_task(client.post("/score", json={"query": "Hold.", "label_token_ids": [0]}))
                await async_wait_until(gate.entered.is_set, what="the first batch to reach the gate")
                tasks = [asyncio.create_task(client.post("/score", json=b)) for b in requests]
                await async_wait_until(lambda: batcher.waiting == units, what="the burst to be queued")
                gate.release()
                await held
                return await asyncio.gather(*tasks)

        together = [r.json() for r in asyncio.run(burst())]
        gate.remove()
    assert gate.sizes == [1, units], f"the burst did not share one batch: {gate.sizes}"
    for a, t in zip(alone, together):
        for da, dt in zip(a["data"], t["data"]):
            assert dt["label_logprobs"] == pytest.approx(da["label_logprobs"], abs=TOL)


def test_gguf_cache_gives_identical_weights(real_loaded, reference_model, default_model_cache):
    """A load from the safetensors cache holds exactly the GGUF's dequantized weights and computes the same logits."""
    from models import load_model
    from tests.reference import last_logits

    assert real_loaded is not None  # the session's first load wrote the cache
    assert any(default_model_cache.glob("gguf/*/config.json"))
    # optimize=False: compare the weights as loaded, before serving kernels re-lay them out.
    cached = load_model("smollm2-135m", device="cpu", dtype="float32", cache_dir=default_model_cache, optimize=False)
    plain, reloaded = reference_model.state_dict(), cached.model.state_dict()
    assert plain.keys() == reloaded.keys()
    assert all(torch.equal(plain[name], reloaded[name]) for name in plain)
    ids = real_loaded.tokenizer(QUERY)["input_ids"]
    # Both called the plain way, model(input_ids).logits. Equal weights, but the dequantized tensors' memory layout
    # differs, so kernels may sum in another order.
    torch.testing.assert_close(last_logits(cached.model, ids), last_logits(reference_model, ids), atol=1e-5, rtol=0)
