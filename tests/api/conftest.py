"""API-tier fixtures: an app on the tiny Llama model, served in-process (TestClient) or on 127.0.0.1."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.conftest import wait_ready

TINY_NAME = "tiny-llama"
# A rerank prompt format (--rerank-format FILE) in the shape of a chat-template judge.
RERANK_FORMAT = {
    "prefix": "<|im_start|>system\nJudge the document.<|im_end|>\n<|im_start|>user\n",
    "query": "Task: {instruction}\nQuery: {query}\nDocument:",
    "document": " {document}",
    "suffix": "<|im_end|>\n<|im_start|>assistant\n",
    "yes": "Yes",
    "no": "No",
    "default_instruction": "find the answer",
}


def tiny_settings(**overrides) -> Settings:
    return Settings(model="unused", served_model_name=TINY_NAME, device="cpu", dtype="float32", **overrides)


@pytest.fixture(scope="session")
def rerank_format_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rerank") / "judge.json"
    path.write_text(json.dumps(RERANK_FORMAT))
    return path


@pytest.fixture(scope="module")
def client(tiny_loaded):
    with TestClient(create_app(tiny_settings(), loaded=tiny_loaded)) as test_client:
        wait_ready(test_client)
        yield test_client


@pytest.fixture(scope="session")
def full_logits(plain_tiny):
    """Reference: the plain transformers model (not the served one), one unpadded sequence, float32
    last-position logits [V]."""
    from tests.reference import last_logits

    return lambda ids: last_logits(plain_tiny, ids)
