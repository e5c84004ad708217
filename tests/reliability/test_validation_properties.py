"""Property tests (hypothesis) for request validation on /score: any body gets a 200 or an OpenAI-shaped 4xx, never a
5xx; every valid request is answered in full; a valid request with one field broken gets a 400 naming that field."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api.score.protocol import ScoreResponse

VOCAB = 327  # the tiny Llama's vocabulary (checked below against the served model)
MAX_TOP_LOGPROBS = 20  # the server default
MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
FIELDS = ["model", "query", "items", "label_token_ids", "apply_softmax", "item_first", "logprobs_mode", "top_logprobs",
          "add_special_tokens", "truncate_prompt_tokens", "temperature", "top_k", "top_p", "min_p", "logit_bias"]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

def finite_floats(**bounds):
    return st.floats(allow_nan=False, allow_infinity=False, **bounds)  # what JSON can carry


token_ids = st.integers(min_value=0, max_value=VOCAB - 1)
words = st.sampled_from("the quick brown fox Paris capital of France is yes no 0 1 A B".split())
text = st.lists(words, min_size=1, max_size=12).map(" ".join)


@st.composite
def valid_requests(draw) -> dict:
    body: dict = {
        "query": draw(st.one_of(text, st.lists(token_ids, min_size=1, max_size=20))),
        "label_token_ids": draw(st.lists(token_ids, min_size=1, max_size=8)),
    }
    if draw(st.booleans()):
        item = st.one_of(text.map(lambda t: " " + t)) if isinstance(body["query"], str) else st.lists(
            token_ids, min_size=0, max_size=6)
        body["items"] = draw(st.lists(item, min_size=1, max_size=4))
        body["item_first"] = draw(st.booleans())
    optional = {
        "logprobs_mode": st.sampled_from(MODES),
        "top_logprobs": st.integers(0, MAX_TOP_LOGPROBS),
        "apply_softmax": st.booleans(),
        "temperature": st.floats(0.01, 100),
        "top_k": st.integers(-1, 2 * VOCAB),
        "top_p": st.floats(0.001, 1),
        "min_p": st.floats(0, 1),
        "logit_bias": st.dictionaries(token_ids.map(str), st.floats(-100, 100), max_size=3),
        "truncate_prompt_tokens": st.integers(1, 64),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            body[name] = draw(strategy)
    return body


def prompt_count(body: dict) -> int:
    return len(body["items"]) if body.get("items") is not None else 1


def assert_openai_error(response) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    return error


def test_the_tiny_vocabulary_is_what_the_strategies_assume(client):
    assert client.post("/score", json={"query": [1], "label_token_ids": [VOCAB - 1]}).status_code == 200
    assert client.post("/score", json={"query": [1], "label_token_ids": [VOCAB]}).status_code == 400


@FUZZ
@given(body=valid_requests())
def test_every_valid_request_is_answered_in_full(client, body):
    # every drawn prompt has at least one token (a word, or a non-empty id list), so nothing may be refused
    response = client.post("/score", json=body)
    assert response.status_code == 200, response.text
    parsed = ScoreResponse.model_validate(response.json())
    assert parsed.logprobs_mode.value == body.get("logprobs_mode", "raw_logprobs")
    assert [d.index for d in parsed.data] == list(range(prompt_count(body)))
    labels = len(body["label_token_ids"])
    for row in parsed.data:
        assert len(row.label_logprobs) == len(row.label_ranks) == labels
        assert all(1 <= rank <= VOCAB for rank in row.label_ranks)
        if "logprobs" in parsed.logprobs_mode.value:
            assert all(v <= 1e-5 for v in row.label_logprobs)  # a logprob (or -9999 for -inf) is never positive
        top = body.get("top_logprobs", 0)
        assert (row.top_logprobs is None) if top == 0 else (len(row.top_logprobs) == top)


any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | finite_floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(body=st.one_of(any_json, st.dictionaries(st.sampled_from(FIELDS), any_json, max_size=6)))
def test_any_json_body_gets_200_or_an_openai_shaped_4xx(client, body):
    response = client.post("/score", json=body)
    if response.status_code != 200:
        assert_openai_error(response)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_any_bytes_get_a_4xx_not_a_crash(client, raw):
    response = client.post("/score", content=raw, headers={"content-type": "application/json"})
    if response.status_code != 200:
        assert_openai_error(response)


# (field, a value that breaks it, the param the 400 must name)
BREAKERS = [
    ("label_token_ids", st.just([]), "label_token_ids"),
    ("label_token_ids", st.lists(st.integers(VOCAB, 10**12), min_size=1, max_size=3), "label_token_ids"),
    ("label_token_ids", st.lists(st.integers(max_value=-1), min_size=1, max_size=3), "label_token_ids"),
    ("label_token_ids", st.lists(st.booleans(), min_size=1, max_size=3), "label_token_ids[0]"),
    ("query", st.lists(st.integers(VOCAB, 10**12), min_size=1, max_size=3), "query"),
    ("query", st.just([]), "query"),
    ("top_logprobs", st.integers(MAX_TOP_LOGPROBS + 1, 10**12), "top_logprobs"),
    ("top_logprobs", st.integers(max_value=-1), "top_logprobs"),
    ("temperature", finite_floats(max_value=0.0099), "temperature"),
    ("top_p", st.one_of(finite_floats(max_value=0.0), finite_floats(min_value=1.0001)), "top_p"),
    ("min_p", finite_floats(min_value=1.0001), "min_p"),
    ("top_k", st.integers(max_value=-2), "top_k"),
    ("logprobs_mode", st.text(max_size=10).filter(lambda s: s not in MODES), "logprobs_mode"),
    ("truncate_prompt_tokens", st.integers(max_value=0), "truncate_prompt_tokens"),
    ("apply_softmax", st.one_of(st.integers(), st.text(max_size=5)), "apply_softmax"),
    ("items", st.just([]), "items"),
]


@FUZZ
@given(body=valid_requests(), breaker=st.sampled_from(BREAKERS), data=st.data())
def test_one_broken_field_is_a_400_naming_it(client, body, breaker, data):
    field, bad_values, param = breaker
    if field == "query":
        body.pop("items", None)  # with items, an empty query is allowed: each item is then the whole prompt
    body[field] = data.draw(bad_values, label=field)
    response = client.post("/score", json=body)
    error = assert_openai_error(response)
    assert response.status_code == 400 and error["param"] == param, (json.dumps(body)[:300], error)


@FUZZ
@given(body=valid_requests(), name=st.text(min_size=1, max_size=12).filter(lambda n: n not in FIELDS))
def test_unknown_fields_are_refused_by_name(client, body, name):
    body[name] = 1
    error = assert_openai_error(client.post("/score", json=body))
    assert error["param"] == name and "unknown field" in error["message"]


@FUZZ
@given(field=st.sampled_from(["temperature", "top_p", "min_p", "top_k", "top_logprobs", "logit_bias"]),
       token=st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]),
       mode=st.sampled_from(MODES))
def test_non_finite_numbers_never_reach_the_model(client, field, token, mode):
    """Python's JSON parser accepts NaN and Infinity; they must be refused (or be harmless), never a 500 or a NaN."""
    value = f'{{"5": {token}}}' if field == "logit_bias" else token
    raw = f'{{"query": "the fox", "label_token_ids": [5, 6], "top_logprobs": 2, "logprobs_mode": "{mode}", ' \
          f'"{field}": {value}}}'
    response = client.post("/score", content=raw, headers={"content-type": "application/json"})
    if response.status_code == 200:
        assert "NaN" not in response.text and "null" not in response.text.split('"scores"')[0]
        ScoreResponse.model_validate(response.json())
    else:
        assert assert_openai_error(response)["param"] == (field if field != "logit_bias" else "logit_bias.5")
