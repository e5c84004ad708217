"""Reranking SmolLM2-135M through the official cohere SDK against a live server: the SDK works unchanged, and every
relevance score equals p(yes) / (p(yes) + p(no)) of the plain float32 transformers forward of the chat prompt."""

from __future__ import annotations

import pytest
import torch

from app.main import create_app
from app.settings import Settings
from tests.conftest import live_server

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Berlin is the capital and largest city of Germany.",
    "Paris is the capital and most populous city of France.",
    "The Eiffel Tower is a wrought-iron lattice tower in Paris.",
    "Bananas are rich in potassium.",
]
SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def server(real_loaded):
    with live_server(create_app(Settings(device="cpu", dtype="float32"), loaded=real_loaded), timeout_s=120) as url:
        yield url


def plain_relevance(reference_model, tokenizer, document: str) -> float:
    """The chat prompt rendered whole by the model's template, tokenized in one piece, scored by plain transformers."""
    user = f"<Instruct>: {INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {document}"
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    yes, no = (tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in ("yes", "no"))
    with torch.inference_mode():
        logprobs = reference_model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    return torch.softmax(logprobs[[yes, no]], -1)[0].item()


def test_cohere_sdk_reranks_unchanged(server, real_loaded, reference_model):
    import cohere

    client = cohere.ClientV2(base_url=server, api_key="unused")
    response = client.rerank(model="smollm2-135m", query=QUERY, documents=DOCUMENTS, top_n=3)
    assert len(response.results) == 3
    scores = [r.relevance_score for r in response.results]
    assert scores == sorted(scores, reverse=True)
    for result in response.results:
        expected = plain_relevance(reference_model, real_loaded.tokenizer, DOCUMENTS[result.index])
        assert result.relevance_score == pytest.approx(expected, abs=1e-4)


def test_documents_share_the_query_prefix(server):
    import httpx

    body = httpx.post(f"{server}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
