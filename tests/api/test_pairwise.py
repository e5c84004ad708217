"""POST /v1/judge/pairwise on the tiny Llama: every pair in both orders, each order's numbers equal to that prompt
sent alone to /score and to plain float32 transformers, the order-averaged probability, the flip flag, a
Bradley-Terry ranking that solves its likelihood equations, and each refusal naming its field."""

from __future__ import annotations

import math

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from tests.api.conftest import tiny_settings
from tests.conftest import wait_ready
from tests.reference import candidate_reference

TEMPLATE = "Question: {question}\nAnswer A: {answer_a}\nAnswer B: {answer_b}\nThe better answer is"
QUESTION = "What color is the sky?"
ANSWERS = ["Blue.", "It is green and red.", "The sky is blue on a clear day."]
LABELS = {"A": [" A", "A"], "B": [" B", "B", " second one"]}


@pytest.fixture(scope="module")
def judge_client(tiny_loaded):
    with TestClient(create_app(tiny_settings(max_judge_pairs=3), loaded=tiny_loaded)) as client:
        wait_ready(client)
        yield client


def fill(first: str, second: str) -> str:
    return TEMPLATE.replace("{question}", QUESTION).replace("{answer_a}", first).replace("{answer_b}", second)


def reference_first(plain, tokenizer, text: str) -> float:
    """p(first label) normalized over the two labels, each the log-sum-exp of its forms, from plain logits."""
    prompt = tokenizer(text, add_special_tokens=True)["input_ids"]
    lse = []
    for forms in LABELS.values():
        sums = [sum(candidate_reference(plain, prompt, tokenizer(f, add_special_tokens=False)["input_ids"],
                                        "raw_logprobs", {})) for f in forms]
        lse.append(torch.logsumexp(torch.tensor(sums, dtype=torch.float64), 0))
    return torch.softmax(torch.stack(lse), 0)[0].item()


def test_both_orders_equal_each_prompt_alone(judge_client, tiny_loaded, plain_tiny):
    out = judge_client.post("/v1/judge/pairwise", json={"template": TEMPLATE, "question": QUESTION,
                                                        "answers": ANSWERS, "labels": LABELS})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["object"] == "judge.pairwise" and body["logprobs_mode"] == "raw_logprobs"
    assert [(c["a"], c["b"]) for c in body["comparisons"]] == [(0, 1), (0, 2), (1, 2)]
    tokenizer = tiny_loaded.tokenizer
    for comparison in body["comparisons"]:
        a, b = comparison["a"], comparison["b"]
        a_first, b_first = comparison["orders"]
        assert (a_first["first"], a_first["second"], b_first["first"], b_first["second"]) == (a, b, b, a)
        alone = [judge_client.post("/score", json={"query": fill(ANSWERS[x], ANSWERS[y]), "labels": LABELS}).json()
                 ["data"][0]["scores"] for x, y in ((a, b), (b, a))]
        assert a_first["win_probability"] == pytest.approx(alone[0][0], abs=1e-6)
        assert b_first["win_probability"] == pytest.approx(alone[1][1], abs=1e-6)
        assert [lab["probability"] for lab in a_first["labels"]] == pytest.approx(alone[0], abs=1e-6)
        assert a_first["win_probability"] == pytest.approx(
            reference_first(plain_tiny, tokenizer, fill(ANSWERS[a], ANSWERS[b])), abs=1e-4)
        assert b_first["win_probability"] == pytest.approx(
            1 - reference_first(plain_tiny, tokenizer, fill(ANSWERS[b], ANSWERS[a])), abs=1e-4)
        mean = (a_first["win_probability"] + b_first["win_probability"]) / 2
        assert comparison["win_probability"] == pytest.approx(mean, abs=1e-12)
        assert comparison["flips"] == ((a_first["win_probability"] > 0.5) != (b_first["win_probability"] > 0.5))
        assert comparison["winner"] == (a if mean > 0.5 else b)
    # the template's text before {answer_a} is shared by all six prompts
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_bradley_terry_solves_its_likelihood_equations(judge_client):
    body = judge_client.post("/v1/judge/pairwise", json={"template": TEMPLATE, "question": QUESTION,
                                                         "answers": ANSWERS, "labels": LABELS}).json()
    strength = {r["index"]: r["strength"] for r in body["ranking"]}
    assert [r["rank"] for r in body["ranking"]] == [1, 2, 3]
    assert [strength[r["index"]] for r in body["ranking"]] == sorted(strength.values(), reverse=True)
    assert sum(strength.values()) == pytest.approx(0.0, abs=1e-9)
    gradient = [0.0] * 3
    for c in body["comparisons"]:
        modelled = 1 / (1 + math.exp(strength[c["b"]] - strength[c["a"]]))
        gradient[c["a"]] += c["win_probability"] - modelled
        gradient[c["b"]] -= c["win_probability"] - modelled
    assert gradient == pytest.approx([0.0] * 3, abs=1e-8)
    two = judge_client.post("/v1/judge/pairwise", json={"template": TEMPLATE, "question": QUESTION,
                                                        "answers": ANSWERS[:2], "labels": LABELS}).json()
    (c,) = two["comparisons"]
    s = {r["index"]: r["strength"] for r in two["ranking"]}
    assert s[0] - s[1] == pytest.approx(math.log(c["win_probability"] / (1 - c["win_probability"])), abs=1e-8)


def test_chat_template_and_response_prefix(judge_client, tiny_loaded, plain_tiny):
    messages = [{"role": "system", "content": "You judge answers."},
                {"role": "user", "content": TEMPLATE}]
    out = judge_client.post("/v1/judge/pairwise", json={"template": messages, "question": QUESTION,
                                                        "answers": ANSWERS[:2], "labels": LABELS,
                                                        "response_prefix": "Verdict:"})
    assert out.status_code == 200, out.text
    tokenizer = tiny_loaded.tokenizer
    text = tokenizer.apply_chat_template([{"role": "system", "content": "You judge answers."},
                                          {"role": "user", "content": fill(ANSWERS[0], ANSWERS[1])}],
                                         tokenize=False, add_generation_prompt=True) + "Verdict:"
    alone = judge_client.post("/score", json={"query": text, "labels": LABELS, "add_special_tokens": False}).json()
    first = out.json()["comparisons"][0]["orders"][0]
    assert first["win_probability"] == pytest.approx(alone["data"][0]["scores"][0], abs=1e-6)


@pytest.mark.parametrize(("body", "param"), [
    ({"template": "A: {answer_a} B: {question}"}, "template"),
    ({"template": "{answer_a} {answer_b}"}, "template"),
    ({"question": None}, "question"),
    ({"answers": ["only one"]}, "answers"),
    ({"answers": ["a", "b", "c", "d"]}, "answers"),
    ({"labels": {"A": [" A"], "B": [" B"], "C": [" C"]}}, "labels"),
    ({"labels": {"A": [], "B": [" B"]}}, "labels.A"),
    ({"labels": {"A": [""], "B": [" B"]}}, "labels.A[0]"),
    ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
    ({"calibrated": True}, "calibrated"),
    ({"answers": ["x " * 200, "y"]}, "answers"),
    ({"template": [{"role": "user", "content": "{answer_a}"}]}, "template"),
])
def test_refusals_name_the_field(judge_client, body, param):
    request = {"template": TEMPLATE, "question": QUESTION, "answers": ANSWERS, "labels": LABELS, **body}
    out = judge_client.post("/v1/judge/pairwise", json=request)
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == param, out.json()
