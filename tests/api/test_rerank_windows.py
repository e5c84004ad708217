"""Long documents in rerank (tiny Llama, a format file): windows over the shared query prefix, each scored as the
plain forward of its own prompt, aggregated by max or mean, with the best window's character span; truncation on
request; a two-label set instead of the format's words; and Text Embeddings Inference's shape on /rerank."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from tests.api.conftest import RERANK_FORMAT, tiny_settings
from tests.api.test_rerank import QUERY
from tests.conftest import wait_ready
from tests.reference import candidate_reference, position_logits

TOL = 1e-5
SHORT = "The sky is blue."
LONG = ("Paris is a city in France with many old streets and bridges over the river. " * 3
        + "The sky is blue on a clear day because air scatters blue light. "
        + "Bananas are yellow fruit that grow in warm places near the sea. " * 3)


@pytest.fixture(scope="module")
def windows_client(tiny_loaded, rerank_format_file):
    settings = tiny_settings(rerank_format=str(rerank_format_file), max_items=8, max_rerank_windows=40)
    with TestClient(create_app(settings, loaded=tiny_loaded)) as client:
        wait_ready(client)
        yield client


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def pieces(tokenizer, instruction=None):
    head = ids(tokenizer, RERANK_FORMAT["prefix"] + RERANK_FORMAT["query"].format(
        instruction=instruction or RERANK_FORMAT["default_instruction"], query=QUERY))
    return head, ids(tokenizer, RERANK_FORMAT["suffix"])


def yes_no_logprobs(plain, tokenizer, prompt: list[int]) -> tuple[float, float]:
    yes, no = (ids(tokenizer, w)[0] for w in ("Yes", "No"))
    logprobs = torch.log_softmax(position_logits(plain, prompt)[-1], -1)
    return logprobs[yes].item(), logprobs[no].item()


def relevance_of(pair):
    return torch.softmax(torch.tensor(pair, dtype=torch.float64), 0)[0].item()


def reference_windows(plain, tokenizer, document, size, stride):
    """Each window of the document's piece (" " + text): its start, end and plain-forward (yes, no) logprobs."""
    head, tail = pieces(tokenizer)
    encoded = tokenizer(" " + document, add_special_tokens=False, return_offsets_mapping=True)
    doc, offsets = encoded["input_ids"], encoded["offset_mapping"]
    starts = list(range(0, len(doc) - size + 1, stride))
    if starts[-1] + size < len(doc):
        starts.append(len(doc) - size)
    out = []
    for start in starts:
        end = min(start + size, len(doc))
        span = (max(offsets[start][0] - 1, 0), offsets[end - 1][1] - 1)
        out.append((span, yes_no_logprobs(plain, tokenizer, head + doc[start:end] + tail)))
    return out


@pytest.mark.parametrize("aggregate", ["max", "mean"])
def test_windows_equal_each_prompt_alone(windows_client, plain_tiny, tiny_loaded, aggregate):
    tokenizer = tiny_loaded.tokenizer
    body = {"query": QUERY, "documents": [SHORT, LONG], "max_tokens_per_doc": 24, "window_size": 20,
            "window_stride": 12, "aggregate": aggregate}
    out = windows_client.post("/v1/rerank", json=body)
    assert out.status_code == 200, out.text
    results = {r["index"]: r for r in out.json()["results"]}
    windows = reference_windows(plain_tiny, tokenizer, LONG, 20, 12)
    relevance = [relevance_of(pair) for _, pair in windows]
    best = max(range(len(relevance)), key=relevance.__getitem__)
    expected = max(relevance) if aggregate == "max" else sum(relevance) / len(relevance)
    long = results[1]
    assert long["relevance_score"] == pytest.approx(expected, abs=TOL)
    assert long["windows"] == len(windows) > 2
    assert (long["span"]["start"], long["span"]["end"]) == windows[best][0]
    head, tail = pieces(tokenizer)
    short = results[0]
    assert "windows" not in short and "span" not in short
    assert short["relevance_score"] == pytest.approx(
        relevance_of(yes_no_logprobs(plain_tiny, tokenizer, head + ids(tokenizer, " " + SHORT) + tail)), abs=TOL)
    # the query prefix is shared by every window of every document
    assert out.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(head) * len(windows)


def test_default_windows_fit_the_context_and_truncation_stays(windows_client, plain_tiny, tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    head, tail = pieces(tokenizer)
    fits = tiny_loaded.max_length - len(head) - len(tail)
    doc = ids(tokenizer, " " + LONG)
    assert len(doc) > fits, "the long document must not fit the tiny model's context"
    windowed = windows_client.post("/v1/rerank", json={"query": QUERY, "documents": [LONG]}).json()["results"][0]
    windows = reference_windows(plain_tiny, tokenizer, LONG, fits, fits - fits // 4)
    assert windowed["windows"] == len(windows)
    assert windowed["relevance_score"] == pytest.approx(max(relevance_of(p) for _, p in windows), abs=TOL)
    cut = windows_client.post("/v1/rerank", json={"query": QUERY, "documents": [LONG], "max_tokens_per_doc": 10,
                                                  "truncate": True}).json()["results"][0]
    assert "windows" not in cut
    assert cut["relevance_score"] == pytest.approx(
        relevance_of(yes_no_logprobs(plain_tiny, tokenizer, head + doc[:10] + tail)), abs=TOL)


def test_two_label_set_replaces_the_format_words(windows_client, plain_tiny, tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    labels = {"relevant": ["Yes", " yes", " relevant"], "irrelevant": ["No", " no"]}
    out = windows_client.post("/v1/rerank", json={"query": QUERY, "documents": [SHORT], "labels": labels})
    assert out.status_code == 200, out.text
    head, tail = pieces(tokenizer)
    prompt = head + ids(tokenizer, " " + SHORT) + tail
    lse = [torch.logsumexp(torch.tensor([sum(candidate_reference(plain_tiny, prompt, ids(tokenizer, f),
                                                                 "raw_logprobs", {})) for f in forms]), 0).item()
           for forms in labels.values()]
    assert out.json()["results"][0]["relevance_score"] == pytest.approx(relevance_of(lse), abs=1e-4)


def test_tei_shape_on_rerank(windows_client, plain_tiny, tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    texts = [SHORT, "Paris is the capital of France.", "Red green yellow."]
    out = windows_client.post("/rerank", json={"query": QUERY, "texts": texts, "return_text": True})
    assert out.status_code == 200, out.text
    ranks = out.json()
    assert isinstance(ranks, list) and [set(r) for r in ranks] == [{"index", "score", "text"}] * 3
    assert [r["score"] for r in ranks] == sorted((r["score"] for r in ranks), reverse=True)
    head, tail = pieces(tokenizer)
    jina = {r["index"]: r["relevance_score"] for r in
            windows_client.post("/rerank", json={"query": QUERY, "documents": texts}).json()["results"]}
    raw = {r["index"]: r["score"] for r in
           windows_client.post("/rerank", json={"query": QUERY, "texts": texts, "raw_scores": True}).json()}
    for rank in ranks:
        pair = yes_no_logprobs(plain_tiny, tokenizer, head + ids(tokenizer, " " + texts[rank["index"]]) + tail)
        assert rank["text"] == texts[rank["index"]]
        assert rank["score"] == pytest.approx(relevance_of(pair), abs=TOL)
        assert rank["score"] == jina[rank["index"]]
        assert raw[rank["index"]] == pytest.approx(pair[0] - pair[1], abs=1e-4)
    bare = windows_client.post("/rerank", json={"query": QUERY, "texts": texts}).json()
    assert [set(r) for r in bare] == [{"index", "score"}] * 3


def test_tei_truncate_keeps_the_end_on_the_left(windows_client, plain_tiny, tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    head, tail = pieces(tokenizer)
    fits = tiny_loaded.max_length - len(head) - len(tail)
    doc = ids(tokenizer, " " + LONG)
    for direction, kept in (("Right", doc[:fits]), ("Left", doc[-fits:])):
        (rank,) = windows_client.post("/rerank", json={"query": QUERY, "texts": [LONG], "truncate": True,
                                                       "truncation_direction": direction}).json()
        assert "windows" not in rank
        assert rank["score"] == pytest.approx(relevance_of(yes_no_logprobs(plain_tiny, tokenizer, head + kept + tail)),
                                              abs=TOL)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/rerank", {"documents": [LONG], "window_size": 10_000}, "window_size"),
    ("/v1/rerank", {"documents": [LONG], "window_size": 8, "window_stride": 9}, "window_stride"),
    ("/v1/rerank", {"documents": [LONG], "window_size": 0}, "window_size"),
    ("/v1/rerank", {"documents": [LONG], "window_size": 4, "window_stride": 1}, "documents"),
    ("/v1/rerank", {"documents": [SHORT], "aggregate": "median"}, "aggregate"),
    ("/v1/rerank", {"documents": [SHORT], "labels": {"a": [" a"], "b": [" b"], "c": [" c"]}}, "labels"),
    ("/v1/rerank", {"documents": [SHORT], "labels": {"a": [""], "b": [" b"]}}, "labels.a[0]"),
    ("/rerank", {"texts": []}, "texts"),
    ("/rerank", {"texts": ["fine", " "]}, "texts[1]"),
    ("/rerank", {"texts": [SHORT], "raw_scores": 1}, "raw_scores"),
    ("/rerank", {"texts": [SHORT], "documents": [SHORT]}, "documents"),
    ("/rerank", {"texts": [SHORT], "truncation_direction": "Up"}, "truncation_direction"),
    ("/rerank", {"documents": [SHORT], "top_n": 0}, "top_n"),
])
def test_refusals_name_the_field(windows_client, path, body, param):
    out = windows_client.post(path, json={"query": QUERY, **body})
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == param, out.json()
