"""Judging on the real default model (SmolLM2-135M) behind a live server: label sets against plain float32
transformers (multi-token forms, a rating whose digits are not all in the top 20), the openai SDK's G-Eval score next
to the server's expected value, a pairwise verdict that flips with the order, a long document whose best window lies
past the truncation point, and `genscore calibrate` end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.conftest import live_server, wait_ready
from tests.reference import candidate_reference

TOL = 1e-4
DATA = Path(__file__).parents[1] / "data" / "judging"
LABEL_SETS = DATA / "label_sets.json"
DIGITS = {str(n): [str(n)] for n in range(1, 6)}
# the first prompt puts every digit in the top 20 next tokens; the second leaves some out
RATING_PROMPTS = [
    "Rate how helpful this answer is on a scale of 1 to 5. Question: What is 2+2? Answer: 4. Reply with a single digit.",
    "On a scale from 1 to 5, how polite is this sentence: 'Thank you so much for your help!' Reply with one digit only.",
]
SENTIMENT_FORMAT = {
    "prefix": "Review of a film: I loved every minute of it.\nSentiment: positive\n"
              "Review of a book: A boring waste of time.\nSentiment: negative\n",
    "query": "Review of {query}:", "document": " {document}", "suffix": "\nSentiment:",
    "yes": " positive", "no": " negative",
}
# A starts with a tiring journey and ends in praise; B is lukewarm all through
LONG_A = ("Our flight was delayed, the taxi was late, and we reached the hotel tired and hungry after midnight. "
          "The staff were wonderful and the breakfast was delicious. We loved it and would happily come back!")
LONG_B = ("The hotel was fine and the room was clean. The bed was comfortable enough and the location was convenient "
          "for the station. Parking cost extra and the lift was small.")


@pytest.fixture(scope="module")
def server(real_loaded, tmp_path_factory):
    folder = tmp_path_factory.mktemp("judging-real")
    fmt = folder / "sentiment_format.json"
    fmt.write_text(json.dumps(SENTIMENT_FORMAT))
    settings = Settings(model="smollm2-135m", device="cpu", dtype="float32", label_sets=LABEL_SETS,
                        rerank_format=str(fmt), access_log=False)
    with live_server(create_app(settings, loaded=real_loaded), timeout_s=300) as base_url:
        yield base_url


def chat_text(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def reference_label_logprobs(model, tokenizer, prompt: list[int], label_set: dict) -> list[float]:
    out = []
    for forms in label_set.values():
        sums = [sum(candidate_reference(model, prompt, tokenizer(f, add_special_tokens=False)["input_ids"],
                                        "raw_logprobs", {})) for f in forms]
        out.append(torch.logsumexp(torch.tensor(sums, dtype=torch.float64), 0).item())
    return out


def test_label_sets_equal_plain_transformers(server, real_loaded, reference_model):
    tokenizer = real_loaded.tokenizer
    yes_no = json.loads(LABEL_SETS.read_text())["yes_no"]
    yes_no = {"yes": yes_no["yes"] + [" Of course"], "no": yes_no["no"] + [" Not at all"]}
    assert all(len(tokenizer(f[-1], add_special_tokens=False)["input_ids"]) > 1 for f in yes_no.values())
    worst = 0.0
    for content, label_set in (("Is Paris in France? Answer yes or no.", yes_no), (RATING_PROMPTS[1], DIGITS)):
        text = chat_text(tokenizer, content)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        body = httpx.post(f"{server}/score", json={"query": text, "labels": label_set, "add_special_tokens": False},
                          timeout=300).json()
        entry = body["data"][0]
        expected = reference_label_logprobs(reference_model, tokenizer, prompt, label_set)
        probabilities = torch.softmax(torch.tensor(expected, dtype=torch.float64), 0).tolist()
        got = [r["logprob"] for r in entry["labels"]]
        worst = max(worst, *(abs(a - b) for a, b in zip(got, expected)),
                    *(abs(r["probability"] - p) for r, p in zip(entry["labels"], probabilities)))
        if label_set is DIGITS:
            top20 = set(torch.log_softmax(reference_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
                        .topk(20).indices.tolist())
            assert any(tokenizer(d, add_special_tokens=False)["input_ids"][0] not in top20 for d in DIGITS)
            expected_value = sum(int(d) * p for d, p in zip(DIGITS, probabilities))
            assert entry["expected_value"] == pytest.approx(expected_value, abs=TOL)
    print(f"label sets, max |delta| against plain float32 transformers: {worst:.2e}")
    assert worst < TOL


def test_openai_sdk_geval_next_to_the_expected_value(server, real_loaded):
    """G-Eval on the client: the probability-weighted digit over the top 20 chat logprobs; the server's expected value
    reads every digit from the full distribution. Equal when every digit is in the top 20."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    tokenizer = real_loaded.tokenizer
    seen = []
    for content in RATING_PROMPTS:
        out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": content}],
                                             max_tokens=1, logprobs=True, top_logprobs=20, temperature=0)
        top = out.choices[0].logprobs.content[0].top_logprobs
        found = {t.token: math.exp(t.logprob) for t in top if t.token in DIGITS}
        client_value = sum(int(d) * p for d, p in found.items()) / sum(found.values())
        entry = httpx.post(f"{server}/score", json={"query": chat_text(tokenizer, content), "labels": DIGITS,
                                                    "add_special_tokens": False}, timeout=300).json()["data"][0]
        if len(found) == len(DIGITS):
            assert entry["expected_value"] == pytest.approx(client_value, abs=1e-5)
        else:
            assert abs(entry["expected_value"] - client_value) > 1e-3  # the top-20 list lost some digits' mass
        seen.append(len(found) == len(DIGITS))
        print(f"G-Eval: {len(found)} digits in the top 20, client {client_value:.6f}, server "
              f"{entry['expected_value']:.6f}")
    assert seen == [True, False]


def test_pairwise_verdict_flips_with_the_order(server):
    template = [{"role": "user", "content": "Which answer to the question is better?\nQuestion: {question}\n"
                 "Answer A: {answer_a}\nAnswer B: {answer_b}\nReply with A or B only."}]
    body = httpx.post(f"{server}/v1/judge/pairwise", json={
        "template": template, "question": "What is the capital of France?", "answers": ["Paris.", "London."],
        "labels": "first_second"}, timeout=300).json()
    (comparison,) = body["comparisons"]
    a_first, b_first = (order["win_probability"] for order in comparison["orders"])
    assert a_first > 0.5 > b_first and comparison["flips"] is True
    assert comparison["win_probability"] == pytest.approx((a_first + b_first) / 2, abs=1e-12)
    print(f"pairwise: p(Paris wins) {a_first:.4f} shown first, {b_first:.4f} shown second, averaged "
          f"{comparison['win_probability']:.4f}, flips {comparison['flips']}")


def test_long_document_best_window_past_the_truncation_point(server, real_loaded):
    tokenizer = real_loaded.tokenizer
    request = {"query": "a hotel", "documents": [LONG_A, LONG_B], "max_tokens_per_doc": 24, "window_size": 24,
               "window_stride": 16, "labels": "sentiment", "return_documents": False}
    cut = httpx.post(f"{server}/v1/rerank", json={**request, "truncate": True}, timeout=300).json()["results"]
    windowed = httpx.post(f"{server}/v1/rerank", json=request, timeout=300).json()["results"]
    assert [r["index"] for r in cut] == [1, 0], cut  # truncated, A is only its tiring journey
    assert [r["index"] for r in windowed] == [0, 1], windowed
    assert windowed[1]["windows"] > 1  # B is long too: the truncated request cut it as well
    best = windowed[0]
    kept = tokenizer.decode(tokenizer(" " + LONG_A, add_special_tokens=False)["input_ids"][:24]).strip()
    assert best["span"]["end"] > len(kept) and "wonderful" in LONG_A[best["span"]["start"]:best["span"]["end"]]
    print(f"rerank: truncated A {cut[1]['relevance_score']:.4f} < B {cut[0]['relevance_score']:.4f}; windowed A "
          f"{best['relevance_score']:.4f} (span {best['span']}) > B {windowed[1]['relevance_score']:.4f}")


def test_calibrate_end_to_end(server, real_loaded, tmp_path):
    rows = DATA.joinpath("sentiment.jsonl").read_text().splitlines()[::9]  # 20 examples, both labels
    data = tmp_path / "sentiment.jsonl"
    data.write_text("\n".join(rows) + "\n")
    output, png = tmp_path / "calibration.json", tmp_path / "reliability.png"
    run = subprocess.run([sys.executable, "-m", "app.cli", "calibrate", "--data", str(data), "--label-set",
                          "sentiment", "--url", server, "--output", str(output), "--plot", str(png)],
                         capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr
    assert "uncalibrated" in run.stdout and "calibrated" in run.stdout, run.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fitted = json.loads(output.read_text())["sentiment"]
    assert fitted["labels"] == ["positive", "negative"] and fitted["temperature"] > 0
    # the server loads the file and applies it to a calibrated request
    settings = Settings(model="smollm2-135m", device="cpu", dtype="float32", label_sets=LABEL_SETS,
                        calibration=output)
    with TestClient(create_app(settings, loaded=real_loaded)) as client:
        wait_ready(client, timeout_s=120)
        query = json.loads(rows[0])["query"]
        entry = client.post("/score", json={"query": query, "labels": "sentiment", "calibrated": True}).json()["data"][0]
    z = torch.tensor([r["logprob"] for r in entry["labels"]], dtype=torch.float64)
    expected = torch.softmax(z / fitted["temperature"] + torch.tensor(fitted["biases"], dtype=torch.float64), 0)
    assert entry["scores"] == pytest.approx(expected.tolist(), abs=1e-9)
    print(run.stdout)
