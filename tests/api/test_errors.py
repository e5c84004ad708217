"""Bad input gets a 4xx with an OpenAI-shaped body naming the field; the server keeps serving."""

from __future__ import annotations

import pytest

GOOD = {"query": "The quick brown fox", "label_token_ids": [5]}


def with_(**changes):
    body = dict(GOOD)
    for key, value in changes.items():
        if value is ...:
            body.pop(key)
        else:
            body[key] = value
    return body


BAD_BODIES = [
    ("label ids out of range", with_(label_token_ids=[5, 10_000]), "label_token_ids"),
    ("negative label id", with_(label_token_ids=[-1]), "label_token_ids"),
    ("empty labels", with_(label_token_ids=[]), "label_token_ids"),
    ("missing labels", with_(label_token_ids=...), "label_token_ids"),
    ("bool as token id", with_(label_token_ids=[True]), "label_token_ids[0]"),
    ("float as token id", with_(label_token_ids=[1.0]), "label_token_ids[0]"),
    ("bool in query ids", with_(query=[5, True]), "query[1]"),
    ("query ids out of range", with_(query=[5, 99_999]), "query"),
    ("missing query", with_(query=...), "query"),
    ("empty query", with_(query=""), "query"),
    ("empty query ids", with_(query=[]), "query"),
    ("empty items", with_(items=[]), "items"),
    ("item ids out of range", with_(items=[[1], [99_999]]), "items[1]"),
    ("top_logprobs over cap", with_(top_logprobs=21), "top_logprobs"),
    ("negative top_logprobs", with_(top_logprobs=-1), "top_logprobs"),
    ("unknown mode", with_(logprobs_mode="logits"), "logprobs_mode"),
    ("zero temperature", with_(temperature=0), "temperature"),
    ("negative temperature", with_(temperature=-1.0), "temperature"),
    ("top_p zero", with_(top_p=0.0), "top_p"),
    ("top_p above one", with_(top_p=1.5), "top_p"),
    ("min_p above one", with_(min_p=2), "min_p"),
    ("top_k below -1", with_(top_k=-2), "top_k"),
    ("string temperature", with_(temperature="0.5"), "temperature"),
    ("logit_bias bad key", with_(logit_bias={"abc": 1.0}), "logit_bias"),
    ("logit_bias id out of range", with_(logit_bias={"99999": 1.0}), "logit_bias"),
    ("unknown field", with_(foo=1), "foo"),
    ("truncate zero", with_(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ("apply_softmax not bool", with_(apply_softmax="yes"), "apply_softmax"),
]


def assert_openai_error(response, status, param=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


@pytest.mark.parametrize(("case", "body", "param"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_fields_are_400_naming_the_field(client, case, body, param):
    error = assert_openai_error(client.post("/score", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"null", b"\xff\xfe", b'{"query": "x", "label_token_ids": [1]'])
def test_malformed_bodies_are_400(client, raw):
    assert_openai_error(client.post("/score", content=raw, headers={"content-type": "application/json"}), 400)


def test_unknown_model_is_404(client):
    error = assert_openai_error(client.post("/score", json=with_(model="gpt-4")), 404, "model")
    assert error["code"] == "model_not_found"


def test_served_model_name_is_accepted(client):
    assert client.post("/score", json=with_(model="tiny-llama")).status_code == 200


def test_unknown_route_and_method_are_openai_shaped(client):
    assert_openai_error(client.get("/nope"), 404)
    assert_openai_error(client.get("/score"), 405)


def test_server_keeps_serving_after_bad_requests(client):
    for _, body, _ in BAD_BODIES:
        client.post("/score", json=body)
    assert client.post("/score", json=GOOD).status_code == 200
    assert client.get("/health").status_code == 200
