"""The rerank routes on the tiny Llama model with a format file: scores against a plain forward of the whole prompt
text, the Jina/vLLM and Cohere v2 shapes, ordering, top_n, the shared prefix, and each refusal naming its field."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from app.main import create_app
from tests.api.conftest import RERANK_FORMAT, TINY_NAME, tiny_settings
from tests.conftest import wait_ready

QUERY = "what color is the sky?"
DOCUMENTS = ["The sky is blue.", "Paris is the capital of France.", "Red green yellow white black."]


def full_text(query: str, document: str, instruction: str = "find the answer") -> str:
    body = RERANK_FORMAT["query"].format(instruction=instruction, query=query) + RERANK_FORMAT["document"].format(document=document)
    return RERANK_FORMAT["prefix"] + body + RERANK_FORMAT["suffix"]


@pytest.fixture(scope="module")
def rerank_client(tiny_loaded, rerank_format_file):
    settings = tiny_settings(rerank_format=str(rerank_format_file), max_items=8)
    with TestClient(create_app(settings, loaded=tiny_loaded)) as client:
        wait_ready(client)
        yield client


@pytest.fixture(scope="module")
def plain(tiny_model_dirs):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()


def relevance(plain, tokenizer, text: str) -> float:
    """p(Yes) / (p(Yes) + p(No)) after the whole prompt text, tokenized in one piece, by the plain model."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    yes, no = (tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in ("Yes", "No"))
    with torch.inference_mode():
        logprobs = plain(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    return torch.softmax(logprobs[[yes, no]], -1)[0].item()


def post(client, path: str, **body):
    return client.post(path, json={"query": QUERY, "documents": DOCUMENTS, **body})


def test_v1_scores_equal_the_plain_forward_and_are_ranked(rerank_client, plain, tiny_loaded):
    out = post(rerank_client, "/v1/rerank", model=TINY_NAME)
    assert out.status_code == 200, out.text
    body = out.json()
    assert set(body) == {"id", "model", "usage", "results"} and body["model"] == TINY_NAME
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert sorted(r["index"] for r in body["results"]) == [0, 1, 2]
    for result in body["results"]:
        document = DOCUMENTS[result["index"]]
        assert result["document"] == {"text": document}
        assert result["relevance_score"] == pytest.approx(relevance(plain, tiny_loaded.tokenizer,
                                                                    full_text(QUERY, document)), abs=1e-5)
    # the query part is shared: computed once per batch, not once per document
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_rerank_alias_instruction_top_n_and_truncation(rerank_client, plain, tiny_loaded):
    body = post(rerank_client, "/rerank", top_n=2, return_documents=False, instruction="rank by color",
                max_tokens_per_doc=3, truncate=True).json()
    assert len(body["results"]) == 2 and all("document" not in r or r["document"] is None for r in body["results"])
    tokenizer = tiny_loaded.tokenizer
    for result in body["results"]:
        head = RERANK_FORMAT["prefix"] + RERANK_FORMAT["query"].format(instruction="rank by color", query=QUERY)
        doc = tokenizer(" " + DOCUMENTS[result["index"]], add_special_tokens=False)["input_ids"][:3]
        text = head + tokenizer.decode(doc) + RERANK_FORMAT["suffix"]
        assert result["relevance_score"] == pytest.approx(relevance(plain, tokenizer, text), abs=1e-5)


def test_v2_has_cohere_shape(rerank_client):
    v1 = post(rerank_client, "/v1/rerank").json()
    v2 = post(rerank_client, "/v2/rerank", top_n=1).json()
    assert set(v2) == {"id", "results", "meta"}
    (best,) = v2["results"]
    assert set(best) == {"index", "relevance_score"}
    assert best["index"] == v1["results"][0]["index"]
    assert best["relevance_score"] == pytest.approx(v1["results"][0]["relevance_score"], abs=1e-12)
    assert v2["meta"]["tokens"]["input_tokens"] == v1["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("body", "param"), [
    ({"documents": []}, "documents"),
    ({"documents": ["a"] * 9}, "documents"),
    ({"top_n": 0}, "top_n"),
    ({"documents": ["fine", "  "]}, "documents[1]"),
    ({"documents": ["fine", {"text": ""}]}, "documents[1]"),
    ({"max_tokens_per_doc": 0}, "max_tokens_per_doc"),
    ({"model": "other"}, "model"),
])
def test_refusals_name_the_field(rerank_client, body, param):
    out = post(rerank_client, "/v1/rerank", **body)
    assert 400 <= out.status_code < 500, out.text
    assert out.json()["error"]["param"] == param


def test_missing_fields_are_refused(rerank_client):
    out = rerank_client.post("/v2/rerank", json={"query": QUERY})
    assert out.status_code == 400 and "documents" in out.json()["error"]["param"]


def test_label_words_of_several_tokens_leave_the_other_routes_serving(tiny_loaded):
    # "yes" and "no" are two tokens each in the tiny vocabulary, and the tiny chat template is the default format
    with TestClient(create_app(tiny_settings(), loaded=tiny_loaded)) as client:
        wait_ready(client)
        out = post(client, "/v1/rerank")
        assert out.status_code == 400
        assert "rerank label word 'yes'" in out.json()["error"]["message"]
        assert client.post("/score", json={"query": QUERY, "label_token_ids": [5]}).status_code == 200


def test_qwen3_reranker_pieces_tokenize_as_the_model_card_does(tiny_loaded):
    """The card tokenizes its prefix, the whole `<Instruct>: ... <Document>: doc` turn, and its suffix; the shared
    head + document pieces must give the same ids."""
    from app.api.rerank.formats import DEFAULT_INSTRUCTION, RerankPrompts, resolve_format

    tokenizer = tiny_loaded.tokenizer
    fmt = resolve_format("qwen3-reranker", tokenizer)
    prompts = RerankPrompts(fmt, tokenizer, 0, 1)  # label ids are not what this test is about
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for query, document in [(QUERY, DOCUMENTS[0]), ("red or blue", "Answer: blue, 7 times.")]:
        body = f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        card = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (prefix, body, suffix)]
        ours = prompts.head(query, None) + prompts.document(document)[0] + prompts.tail()
        assert ours == card[0] + card[1] + card[2]
