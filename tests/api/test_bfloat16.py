"""bfloat16 end to end on the tiny Llama, over real HTTP: load with the serving kernels, score, and generate, each
against the same weights loaded the plain transformers way in bfloat16."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch

import models.loading
import models.prepack
from app.main import create_app
from app.settings import Settings
from models import load_model
from models.cpu_features import bfloat16_packing_missing
from models.forward import forward_logits
from models.prepack import PrepackedLinear
from tests.conftest import live_server
from tests.reference import greedy_reference, plain_model, position_logits

QUERY = [5, 6, 7, 8, 9, 10, 11, 12]
ITEMS = [[30, 31], [], [40, 41, 42, 43, 44]]
LABELS = [0, 5, 17, 100, 300]


@pytest.fixture(scope="module")
def bf16(tiny_model_dirs):
    folder = tiny_model_dirs["llama"]
    loaded = load_model(str(folder), "cpu", "bfloat16")
    plain = plain_model(folder, dtype=torch.bfloat16)
    app = create_app(Settings(model="unused", served_model_name="tiny-llama", device="cpu", dtype="bfloat16"),
                     loaded=loaded)
    with live_server(app) as base_url:
        yield base_url, loaded, plain


def _linear_kinds(model) -> set[type]:
    return {type(m) for m in model.base_model.modules() if isinstance(m, (torch.nn.Linear, PrepackedLinear))}


def test_the_served_model_is_bfloat16_with_the_kernels_this_cpu_runs(bf16):
    """Pre-packed bfloat16 linears where oneDNN packs bfloat16 natively; plain nn.Linear where it cannot."""
    _, loaded, plain = bf16
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in plain.parameters()} == {torch.bfloat16}
    missing = bfloat16_packing_missing()
    assert _linear_kinds(loaded.model) == ({PrepackedLinear} if missing is None else {torch.nn.Linear}), missing


def test_bfloat16_linears_stay_plain_with_a_warning_where_the_cpu_cannot_pack_them(tiny_model_dirs, monkeypatch,
                                                                                   caplog):
    """The fallback, forced on a CPU that has the kernels: the model loads, its linears stay nn.Linear, WARNINGs
    say why (and that bfloat16 is slow here), and its scores are the plain bfloat16 model's."""
    monkeypatch.setattr(models.prepack, "bfloat16_packing_missing", lambda: "no bfloat16 packing on this test CPU")
    monkeypatch.setattr(models.loading, "native_bfloat16_missing", lambda: "no bfloat16 instructions on this test CPU")
    folder = tiny_model_dirs["llama"]
    with caplog.at_level(logging.WARNING, logger="genscore.models"):
        loaded = load_model(str(folder), "cpu", "bfloat16")
    assert _linear_kinds(loaded.model) == {torch.nn.Linear}
    assert "no bfloat16 packing on this test CPU" in caplog.text and "plain nn.Linear" in caplog.text
    assert "no bfloat16 instructions on this test CPU" in caplog.text and "slower than float32" in caplog.text
    plain = plain_model(folder, dtype=torch.bfloat16)
    sequences = [QUERY, QUERY + ITEMS[2]]
    got = forward_logits(loaded.model, loaded.plan, sequences, loaded.pad_token_id)  # [2, V]
    expected = torch.stack([position_logits(plain, s)[-1] for s in sequences])
    # the plain model rounds its logits to bfloat16, the served head keeps them in float32 (models/float32_head.py):
    # up to half a bfloat16 ulp apart (2^-8 of the logit) on top of kernels that sum in another order
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=2**-8)


def test_bfloat16_scores_match_the_plain_bfloat16_model(bf16):
    base_url, _, plain = bf16
    response = httpx.post(f"{base_url}/score", timeout=30, json={
        "query": QUERY, "items": ITEMS, "label_token_ids": LABELS, "top_logprobs": 3})
    assert response.status_code == 200, response.text
    for item, entry in zip(ITEMS, response.json()["data"]):
        logits = position_logits(plain, QUERY + item)[-1]  # [V], float32 of bf16 logits
        expected = torch.log_softmax(logits, -1)
        # bf16 carries 8 bits of mantissa: kernels that sum in another order, or round once where the plain model
        # rounds twice (the CPU attention kernel computes in float32), move logits by up to an ulp of their size, and
        # a logprob by the label's logit's move plus the log-sum-exp's, which follows the largest logits: one ulp of
        # the largest logit bounds it
        ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(logits.abs().max())).item()
        assert entry["label_logprobs"] == pytest.approx(expected[LABELS].tolist(), abs=ulp, rel=0)
        assert [t["token_id"] for t in entry["top_logprobs"]][:1] == expected.topk(1).indices.tolist()


def test_bfloat16_greedy_generation_matches_the_plain_bfloat16_model(bf16):
    base_url, loaded, plain = bf16
    prompt = [5, 6, 7, 8]
    response = httpx.post(f"{base_url}/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0})
    assert response.status_code == 200, response.text
    expected = greedy_reference(plain, prompt, 8, loaded.pad_token_id)
    eos = loaded.tokenizer.eos_token_id
    if eos in expected:
        expected = expected[:expected.index(eos) + 1]
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [loaded.tokenizer.decode([t]) for t in expected]
