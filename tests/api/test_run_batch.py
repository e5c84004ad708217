"""`genscore run-batch`: one output line per input line, each equal to the HTTP route's answer; bad lines become error
lines; a torn or killed run resumes with every custom_id exactly once; shards cover every line exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.batch_runner import BatchInputError, BatchOptions, run_batch
from app.main import create_app
from tests.api.conftest import RERANK_FORMAT, tiny_settings
from tests.conftest import share_kernels, wait_ready

# fields that differ between any two answers of the same request
_VOLATILE = {"id", "created", "request_id"}


def _requests() -> list[dict]:
    rows = []
    for i in range(4):
        rows.append({"custom_id": f"score-{i}", "method": "POST", "url": "/score",
                     "body": {"query": "The quick brown fox" + " jumps" * i, "items": [" yes", " no"],
                              "label_token_ids": [5, 6, 7], "top_logprobs": 2}})
        rows.append({"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
                     "body": {"prompt": "Paris is" + " the" * i, "max_tokens": 4, "temperature": 0, "logprobs": 1}})
    rows.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 3,
                          "temperature": 0}})
    rows.append({"custom_id": "rerank", "method": "POST", "url": "/v1/rerank",
                 "body": {"query": "sky color", "documents": ["The sky is blue.", "Paris is in France."]}})
    rows.append({"custom_id": "bad-body", "method": "POST", "url": "/score",
                 "body": {"query": "x", "label_token_ids": [10 ** 6]}})
    rows.append({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}})
    rows.append({"custom_id": "bad-body-type", "method": "POST", "url": "/score", "body": "not an object"})
    return rows


def _write_input(path: Path) -> list[dict]:
    rows = _requests()
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, "{not json")
    path.write_text("\n".join(lines) + "\n")
    return rows


def _without_volatile(value):
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def _assert_close(got, want, where="body") -> None:
    """Equal, numbers within 1e-4: rows batched with other rows may differ from rows alone by float rounding."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            _assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    fmt = tmp_path_factory.mktemp("batch-format") / "judge.json"
    fmt.write_text(json.dumps(RERANK_FORMAT))
    return tiny_settings(rerank_format=str(fmt), request_timeout_s=0, access_log=False)


async def test_every_line_is_answered_as_the_route_answers(tmp_path, settings, tiny_loaded):
    rows = _write_input(tmp_path / "in.jsonl")
    counts = await run_batch(settings, BatchOptions(tmp_path / "in.jsonl", tmp_path / "out.jsonl"), loaded=tiny_loaded)
    out = _read(tmp_path / "out.jsonl")
    assert counts == {"written": len(rows) + 1, "skipped": 0, "errors": 4}
    assert len(out) == len(rows) + 1
    assert out[5]["custom_id"] is None and out[5]["error"]["code"] == "invalid_json"
    answers = out[:5] + out[6:]
    with TestClient(create_app(settings, loaded=tiny_loaded)) as client:
        wait_ready(client)
        for row, answer in zip(rows, answers):
            assert answer["custom_id"] == row["custom_id"]
            if row["custom_id"] == "bad-url":
                assert answer["response"] is None and answer["error"]["code"] == "invalid_url"
                continue
            if row["custom_id"] == "bad-body-type":
                assert answer["response"] is None and answer["error"]["code"] == "invalid_request"
                continue
            direct = client.post(row["url"], json=row["body"])
            assert answer["error"] is None
            assert answer["response"]["status_code"] == direct.status_code
            _assert_close(_without_volatile(answer["response"]["body"]), _without_volatile(direct.json()))
    assert next(a for a in answers if a["custom_id"] == "bad-body")["response"]["status_code"] == 400


async def test_a_pairwise_judge_line_is_answered_as_the_route_answers(tmp_path, settings, tiny_loaded):
    body = {"template": "Q: {question}\nA: {answer_a}\nB: {answer_b}\nBetter:", "question": "Sky color?",
            "answers": ["Blue.", "Green."], "labels": {"A": [" A"], "B": [" B"]}}
    row = {"custom_id": "judge", "method": "POST", "url": "/v1/judge/pairwise", "body": body}
    (tmp_path / "in.jsonl").write_text(json.dumps(row) + "\n")
    await run_batch(settings, BatchOptions(tmp_path / "in.jsonl", tmp_path / "out.jsonl"), loaded=tiny_loaded)
    (answer,) = _read(tmp_path / "out.jsonl")
    assert answer["error"] is None, answer["error"]
    assert answer["response"]["status_code"] == 200 and answer["response"]["body"]["object"] == "judge.pairwise"
    with TestClient(create_app(settings, loaded=tiny_loaded)) as client:
        wait_ready(client)
        direct = client.post(row["url"], json=body).json()
    _assert_close(_without_volatile(answer["response"]["body"]), _without_volatile(direct))


async def test_a_torn_output_resumes_without_loss_or_duplicates(tmp_path, settings, tiny_loaded):
    _write_input(tmp_path / "in.jsonl")
    whole = tmp_path / "whole.jsonl"
    await run_batch(settings, BatchOptions(tmp_path / "in.jsonl", whole), loaded=tiny_loaded)
    lines = whole.read_text().splitlines(keepends=True)
    torn = tmp_path / "torn.jsonl"
    torn.write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])  # a kill in the middle of line 5
    with pytest.raises(BatchInputError, match="--resume"):
        await run_batch(settings, BatchOptions(tmp_path / "in.jsonl", torn), loaded=tiny_loaded)
    counts = await run_batch(settings, BatchOptions(tmp_path / "in.jsonl", torn, resume=True), loaded=tiny_loaded)
    assert counts["skipped"] == 4 and counts["written"] == len(lines) - 4
    _assert_close([_without_volatile(a) for a in _read(torn)], [_without_volatile(a) for a in _read(whole)])
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"custom_id": "elsewhere"}) + "\n")
    with pytest.raises(BatchInputError, match="does not continue"):
        await run_batch(settings, BatchOptions(tmp_path / "in.jsonl", other, resume=True), loaded=tiny_loaded)


async def test_shards_cover_every_line_exactly_once(tmp_path, settings, tiny_loaded):
    rows = _write_input(tmp_path / "in.jsonl")
    seen = []
    for shard in range(3):
        out = tmp_path / f"out-{shard}.jsonl"
        await run_batch(settings, BatchOptions(tmp_path / "in.jsonl", out, shard=shard, shards=3), loaded=tiny_loaded)
        seen += [a["custom_id"] for a in _read(out)]
    assert sorted(map(str, seen)) == sorted(map(str, [r["custom_id"] for r in rows] + [None]))


def test_a_killed_process_resumes_with_each_custom_id_once(tmp_path, tiny_model_dirs, built_kernels):
    rows = [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"Line {i}: the", "max_tokens": 6, "temperature": 0}} for i in range(80)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "app.cli", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out),
               "--concurrency", "2", "--model", str(tiny_model_dirs["llama"]), "--device", "cpu",
               "--cache-dir", str(share_kernels(tmp_path / "cache", built_kernels))]
    env = {**os.environ, "GENSCORE_LOG_LEVEL": "warning"}
    process = subprocess.Popen([*command], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while (not out.exists() or out.read_text().count("\n") < 3) and process.poll() is None:
            assert time.monotonic() < deadline, "run-batch wrote nothing"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    resumed = subprocess.run([*command, "--resume"], env=env, capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    ids = [a["custom_id"] for a in _read(out)]
    assert ids == [r["custom_id"] for r in rows]  # every row once, in input order
