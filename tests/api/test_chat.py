"""POST /v1/chat/completions on a tiny model with a ChatML template: the template is applied, shapes field by field,
logprobs entries, streaming chunks, a model without a template, unsupported fields; and the openai SDK."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from tests.api.conftest import TINY_NAME, tiny_settings
from tests.conftest import live_server, wait_ready

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What color is the sky?"}]


def chat(client, **body):
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert response.status_code == 200, response.text
    return response.json()


def rendered_ids(loaded, messages=MESSAGES):
    text = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_response_shape_field_by_field(client, tiny_loaded):
    out = chat(client, model=TINY_NAME, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion" and out["model"] == TINY_NAME
    (choice,) = out["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert set(choice["message"]) == {"role", "content", "refusal"}
    assert set(choice["logprobs"]) == {"content", "refusal"}
    content = choice["logprobs"]["content"]
    assert 1 <= len(content) <= 5
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(entry["logprob"], float) and all(isinstance(b, int) and 0 <= b < 256 for b in entry["bytes"])
        assert len(entry["top_logprobs"]) == 2
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    prompt_tokens = len(rendered_ids(tiny_loaded))
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(content),
                            "total_tokens": prompt_tokens + len(content)}


def test_chat_is_the_template_then_greedy_generation(client, tiny_loaded, plain_tiny):
    """Chat = completions on the rendered template, token for token, with the same logprobs."""
    ids = rendered_ids(tiny_loaded)
    by_chat = chat(client, max_tokens=8, temperature=0, logprobs=True)["choices"][0]
    by_completion = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                         "logprobs": 0}).json()["choices"][0]
    assert by_chat["message"]["content"] == by_completion["text"]
    assert [e["logprob"] for e in by_chat["logprobs"]["content"]] == by_completion["logprobs"]["token_logprobs"]
    with torch.inference_mode():
        first = torch.log_softmax(plain_tiny(torch.tensor([ids])).logits[0, -1].float(), -1)
    assert by_chat["logprobs"]["content"][0]["logprob"] == pytest.approx(first.max().item(), abs=1e-5)


def test_token_bytes_are_the_raw_bytes(client):
    content = chat(client, max_tokens=6, temperature=0, logprobs=True)["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in content)  # a token's bytes may be half a character
    text = chat(client, max_tokens=6, temperature=0)["choices"][0]["message"]["content"]
    assert joined.decode("utf-8", errors="replace") == text


def test_max_completion_tokens_and_n(client):
    out = chat(client, max_completion_tokens=3, n=2, temperature=1.0, seed=5)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] <= 6
    assert all(c["logprobs"] is None for c in out["choices"])


def test_stream_chunk_shapes(client):
    full = chat(client, max_tokens=6, temperature=0, logprobs=True)
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                                                         "logprobs": True, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    lines = [line for line in response.text.split("\n") if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    first, *middle, last = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content, logprobs, finish = "", [], None
    for chunk in [first, *middle]:
        assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
        assert set(chunk) == {"id", "object", "created", "model", "choices", "usage"}
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}
        content += choice["delta"].get("content", "")
        if choice["logprobs"]:
            logprobs += choice["logprobs"]["content"]
        finish = choice["finish_reason"] or finish
    assert content == full["choices"][0]["message"]["content"]
    assert logprobs == full["choices"][0]["logprobs"]["content"]
    assert finish == full["choices"][0]["finish_reason"]
    assert last["choices"] == [] and last["usage"] == full["usage"]


def test_text_content_parts_are_joined(client):
    parts = [{"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": [{"type": "text", "text": "What color "}, {"type": "text", "text": "is the sky?"}]}]
    by_parts = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 4, "temperature": 0}).json()
    assert by_parts["choices"][0]["message"] == chat(client, max_tokens=4, temperature=0)["choices"][0]["message"]


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"max_completion_tokens": 10_000}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"frobnicate": True}, "frobnicate"),
])
def test_bad_requests_get_a_400_naming_the_field(client, extra, param):
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_model_without_chat_template_is_400(tiny_loaded):
    tokenizer = copy.deepcopy(tiny_loaded.tokenizer)
    tokenizer.chat_template = None
    loaded = replace(tiny_loaded, tokenizer=tokenizer)
    with TestClient(create_app(tiny_settings(), loaded=loaded)) as client:
        wait_ready(client)
        response = client.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert response.status_code == 400
        assert "chat template" in response.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


@pytest.fixture(scope="module")
def sdk(tiny_loaded):
    with live_server(create_app(tiny_settings(), loaded=tiny_loaded)) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_sdk_chat_and_stream(sdk):
    out = sdk.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_completion_tokens=5, temperature=0,
                                      logprobs=True, top_logprobs=3)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert len(out.choices[0].logprobs.content[0].top_logprobs) == 3
    stream = sdk.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_completion_tokens=5, temperature=0,
                                         stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == out.choices[0].message.content


def test_sdk_chat_error(sdk):
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=TINY_NAME, messages=MESSAGES,
                                    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert bad.value.body["param"] == "tools"
