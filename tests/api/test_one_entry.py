"""Every scoring route enters the engine the same way: Engine.score with a ScoreQuery of token ids, the request
rendered and tokenized in the API layer."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.engine.work import ScoreQuery
from app.main import create_app
from tests.api.conftest import tiny_settings
from tests.conftest import wait_ready

TEMPLATE = "Question: {question}\nAnswer A: {answer_a}\nAnswer B: {answer_b}\nThe better answer is"
LABELS = {"A": [" A"], "B": [" B"]}

REQUESTS = {
    "score labels": ("/score", {"query": "The sky is", "items": [" blue", " green"], "label_token_ids": [5, 6]}),
    "score candidates": ("/score", {"query": "The sky is", "candidates": [[7, 8], [9]]}),
    "score label set": ("/score", {"query": "The sky is", "labels": {"yes": [" yes"], "no": [" no"]}}),
    "sglang text": ("/v1/score", {"query": "The sky is", "items": [" blue"], "label_token_ids": [5]}),
    "sglang ids": ("/v1/score", {"query": [9, 10], "items": [[11], [12, 13]], "label_token_ids": [5]}),
    "vllm": ("/generative_scoring", {"query": "The sky is", "items": [" blue", " red"], "label_token_ids": [5, 6]}),
    "rerank": ("/v1/rerank", {"query": "sky color?", "documents": ["The sky is blue.", "Paris."]}),
    "judge": ("/v1/judge/pairwise", {"template": TEMPLATE, "question": "Sky?", "answers": ["Blue.", "Red."],
                                     "labels": LABELS}),
}


@pytest.fixture(scope="module")
def entry(tiny_loaded, rerank_format_file):
    settings = tiny_settings(rerank_format=str(rerank_format_file))
    with TestClient(create_app(settings, loaded=tiny_loaded)) as client:
        wait_ready(client)
        engine = client.app.state.lifecycle.engine
        queries: list = []
        original = engine.score

        async def recording(query, *args, **kwargs):
            queries.append((query, args, kwargs))
            return await original(query, *args, **kwargs)

        engine.score = recording
        try:
            yield client, queries
        finally:
            engine.score = original


@pytest.mark.parametrize("name", list(REQUESTS))
def test_each_scoring_route_hands_the_engine_token_ids(entry, name):
    client, queries = entry
    queries.clear()
    path, body = REQUESTS[name]
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert len(queries) == 1, "one call into the engine per request"
    query, args, kwargs = queries[0]
    assert isinstance(query, ScoreQuery) and not args and not kwargs
    assert query.prompts and all(p and all(type(t) is int for t in p) for p in query.prompts)
    assert all(c and all(type(t) is int for t in c) for c in query.candidates)
