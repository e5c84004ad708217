"""Label sets on /score (tiny Llama): each label's logprob is the log-sum-exp of its surface forms, each form scored
as a candidate; the numbers equal the same computation on plain float32 transformers logits; named sets and their
calibration come from the server's files; each refusal names its field."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from tests.api.conftest import tiny_settings
from tests.conftest import wait_ready
from tests.reference import candidate_reference, position_logits

TOL = 1e-4
QUERY = "Question: is the sky blue? Answer:"
ITEMS = ["", " I think", " Well,"]
YES_NO = {"yes": [" Yes", "Yes", " yes", " indeed so"], "no": [" No", "No", " not really"]}
RATING = {str(n): [str(n), f" {n}"] for n in range(1, 6)}
PROCESSORS = {"temperature": 1.5, "top_k": 200}


def ids_of(loaded, text, special=True):
    return loaded.tokenizer(text, add_special_tokens=special)["input_ids"]


def reference_labels(plain, loaded, prompt: list[int], label_set: dict, mode="raw_logprobs", processors=None):
    """Per label: log-sum-exp over its forms of the sum of each form token's logprob, from plain float32 logits."""
    out = {}
    for label, forms in label_set.items():
        sums = []
        for form in forms:
            ids = ids_of(loaded, form, False) if isinstance(form, str) else form
            sums.append(sum(candidate_reference(plain, prompt, ids, mode, processors or {})))
        out[label] = torch.logsumexp(torch.tensor(sums, dtype=torch.float64), 0).item()
    return out


def expected_distribution(logprobs: dict) -> dict:
    values = torch.tensor(list(logprobs.values()), dtype=torch.float64)
    return dict(zip(logprobs, torch.softmax(values, 0).tolist()))


@pytest.fixture(scope="module")
def judging_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("judging")
    sets = folder / "label_sets.json"
    sets.write_text(json.dumps({"yes_no": YES_NO, "rating": RATING}))
    calibration = folder / "calibration.json"
    calibration.write_text(json.dumps({"yes_no": {"labels": ["yes", "no"], "temperature": 2.5, "biases": [0.0, 0.75],
                                                  "logprobs_mode": "raw_logprobs", "model": "tiny-llama"}}))
    return sets, calibration


@pytest.fixture(scope="module")
def label_client(tiny_loaded, judging_files):
    sets, calibration = judging_files
    with TestClient(create_app(tiny_settings(label_sets=sets, calibration=calibration), loaded=tiny_loaded)) as c:
        wait_ready(c)
        yield c


def test_multi_token_forms_equal_plain_transformers(label_client, tiny_loaded, plain_tiny):
    out = label_client.post("/score", json={"query": QUERY, "items": ITEMS, "labels": YES_NO})
    assert out.status_code == 200, out.text
    body = out.json()
    assert any(len(ids_of(tiny_loaded, f, False)) > 1 for forms in YES_NO.values() for f in forms)
    worst = 0.0
    for item, entry in zip(ITEMS, body["data"]):
        prompt = ids_of(tiny_loaded, QUERY) + ids_of(tiny_loaded, item, False)
        reference = reference_labels(plain_tiny, tiny_loaded, prompt, YES_NO)
        probabilities = expected_distribution(reference)
        assert [r["label"] for r in entry["labels"]] == ["yes", "no"]
        for result in entry["labels"]:
            worst = max(worst, abs(result["logprob"] - reference[result["label"]]),
                        abs(result["probability"] - probabilities[result["label"]]))
            assert len(result["form_logprobs"]) == len(YES_NO[result["label"]])
            assert result["logprob"] == pytest.approx(torch.logsumexp(torch.tensor(result["form_logprobs"],
                                                                                   dtype=torch.float64), 0).item())
        assert entry["scores"] == [r["probability"] for r in entry["labels"]]
        best = max(probabilities, key=probabilities.get)
        assert entry["prediction"] == best
        p = sorted(probabilities.values(), reverse=True)
        assert entry["margin"] == pytest.approx(p[0] - p[1], abs=TOL)
        assert entry["entropy"] == pytest.approx(-sum(q * math.log(q) for q in p), abs=TOL)
        assert entry["expected_value"] is None and entry["calibrated"] is False
    print(f"tiny label sets, max |delta|: {worst:.2e}")
    assert worst < TOL, worst


def test_numeric_set_expected_value_uses_the_full_distribution(label_client, tiny_loaded, plain_tiny):
    prompt = ids_of(tiny_loaded, QUERY)
    logprobs = torch.log_softmax(position_logits(plain_tiny, prompt)[-1], -1)
    top20 = set(logprobs.topk(20).indices.tolist())
    digits = [ids_of(tiny_loaded, form, False) for forms in RATING.values() for form in forms]
    outside = [d for d in digits if len(d) == 1 and d[0] not in top20]
    assert outside, "every digit is in the top 20: this would not test the full distribution"
    entry = label_client.post("/score", json={"query": QUERY, "labels": "rating"}).json()["data"][0]
    probabilities = expected_distribution(reference_labels(plain_tiny, tiny_loaded, prompt, RATING))
    expected = sum(int(label) * p for label, p in probabilities.items())
    assert entry["expected_value"] == pytest.approx(expected, abs=TOL)
    assert [r["probability"] for r in entry["labels"]] == pytest.approx(list(probabilities.values()), abs=TOL)


def test_processed_mode_and_token_id_forms(label_client, tiny_loaded, plain_tiny):
    label_set = {"a": [[5], [6, 7]], "b": [" blue", [9]]}
    out = label_client.post("/score", json={"query": QUERY, "labels": label_set, "logprobs_mode": "processed_logprobs",
                                            **PROCESSORS}).json()
    (entry,) = out["data"]
    reference = reference_labels(plain_tiny, tiny_loaded, ids_of(tiny_loaded, QUERY), label_set,
                                 "processed_logprobs", PROCESSORS)
    assert out["logprobs_mode"] == "processed_logprobs"
    for result in entry["labels"]:
        assert result["logprob"] == pytest.approx(max(reference[result["label"]], -9999.0), abs=TOL)


def test_single_token_forms_equal_label_token_ids(label_client, tiny_loaded):
    forms = {"x": [[5]], "y": [[17]], "z": [[100]]}
    by_set = label_client.post("/score", json={"query": QUERY, "labels": forms}).json()["data"][0]
    by_ids = label_client.post("/score", json={"query": QUERY, "label_token_ids": [5, 17, 100],
                                               "apply_softmax": True}).json()["data"][0]
    assert [r["logprob"] for r in by_set["labels"]] == pytest.approx(by_ids["label_logprobs"], abs=1e-6)
    assert by_set["scores"] == pytest.approx(by_ids["scores"], abs=1e-6)


def test_named_set_equals_inline_and_calibration_applies(label_client):
    named = label_client.post("/score", json={"query": QUERY, "items": ITEMS, "labels": "yes_no"}).json()
    inline = label_client.post("/score", json={"query": QUERY, "items": ITEMS, "labels": YES_NO}).json()
    assert named["data"] == inline["data"]
    calibrated = label_client.post("/score", json={"query": QUERY, "items": ITEMS, "labels": "yes_no",
                                                   "calibrated": True}).json()
    for plain, entry in zip(named["data"], calibrated["data"]):
        yes, no = (r["logprob"] for r in plain["labels"])
        z = torch.tensor([yes / 2.5, no / 2.5 + 0.75], dtype=torch.float64)
        expected = torch.softmax(z, 0).tolist()
        assert entry["calibrated"] is True
        assert [r["calibrated_probability"] for r in entry["labels"]] == pytest.approx(expected, abs=1e-9)
        assert entry["scores"] == pytest.approx(expected, abs=1e-9)
        assert [r["probability"] for r in entry["labels"]] == [r["probability"] for r in plain["labels"]]
        assert entry["prediction"] == ("yes" if expected[0] >= expected[1] else "no")


@pytest.mark.parametrize(("body", "param"), [
    ({"labels": {"yes": [], "no": [" No"]}}, "labels.yes"),
    ({"labels": {"yes": [""], "no": [" No"]}}, "labels.yes[0]"),
    ({"labels": {"yes": [" Yes"], "no": [" No", []]}}, "labels.no[1]"),
    ({"labels": {"yes": [" Yes"], "no": [[99_999]]}}, "labels.no[0]"),
    ({"labels": {"yes": [" Yes"], "no": [" Yes"]}}, "labels.no[0]"),
    ({"labels": {"yes": [" Yes", " Yes, it is"], "no": [" No"]}}, "labels.yes[1]"),
    ({"labels": {"yes": [" Yes, it is"], "no": [" No", " Yes"]}}, "labels.yes[0]"),
    ({"labels": {"yes": [" Yes"]}}, "labels"),
    ({"labels": {}}, "labels"),
    ({"labels": "nope"}, "labels"),
    ({"labels": "yes_no", "label_token_ids": [5]}, "label_token_ids"),
    ({"labels": "yes_no", "candidates": [" a"]}, "candidates"),
    ({"labels": "yes_no", "logprobs_mode": "raw_logits"}, "logprobs_mode"),
    ({"labels": "rating", "calibrated": True}, "calibrated"),
    ({"labels": YES_NO, "calibrated": True}, "calibrated"),
    ({"labels": "yes_no", "calibrated": True, "logprobs_mode": "processed_logprobs"}, "calibrated"),
    ({"label_token_ids": [5], "calibrated": True}, "calibrated"),
    ({"labels": {"x": [" a"] * 200, "y": [" b"] * 57}}, "labels"),
])
def test_bad_label_sets_are_400_naming_the_field(label_client, body, param):
    out = label_client.post("/score", json={"query": QUERY, **body})
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == param, out.json()


def test_bad_label_sets_file_stops_the_start(tmp_path):
    path = tmp_path / "sets.json"
    path.write_text(json.dumps({"broken": {"yes": []}}))
    with pytest.raises(ValueError, match="broken.yes"):
        tiny_settings(label_sets=path)
    calibration = tmp_path / "calibration.json"
    path.write_text(json.dumps({"yes_no": YES_NO}))
    calibration.write_text(json.dumps({"yes_no": {"labels": ["no", "yes"], "temperature": 1.0, "biases": [0, 0],
                                                  "logprobs_mode": "raw_logprobs"}}))
    with pytest.raises(ValueError, match="fitted for labels"):
        tiny_settings(label_sets=path, calibration=calibration)
