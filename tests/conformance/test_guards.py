"""A fast path can never stop a model from loading: a path that raises while being installed or checked is switched
off with a WARNING naming it and the error, and the model is served through the plain path, exactly."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch

import models.forward
import models.selfcheck
from app.main import create_app
from app.settings import Settings
from models import forward_logits, load_model
from models.decoding import decode_step, prefill
from models.head import head_logits
from tests.conftest import live_server
from tests.reference import position_logits


def _boom(*_a, **_k):
    raise RuntimeError("simulated failure")


def _only_packed(real):
    def forward(model, plan, *args, **kwargs):  # the packed layout raises; any other runs as it is
        if plan.layout == "packed":
            raise RuntimeError("simulated failure")
        return real(model, plan, *args, **kwargs)
    return forward


# (what raises, the path it must switch off, what the plan falls back to)
GUARDS = {
    "installing pre-packed linears": ("prepack_linears", "prepacked_linears", lambda p: p.held_head is None),
    "installing packed attention": ("use_packed_attention", "packed_batches", lambda p: p.layout != "packed"),
    "checking packed batches": ("forward_logits", "packed_batches", lambda p: p.layout != "packed"),
    "checking shared-prefix reuse": ("prefill_prefixes", "shared_prefix", lambda p: p.prefix_reuse != "key_values"),
    "the packed-suffix step itself": ("can_pack_suffixes", "shared_prefix", lambda p: not p.packed_suffixes),
    "checking batched decoding": ("decode_step", "batched_decoding", lambda p: p.decoding == "recompute"),
}


@pytest.mark.parametrize("case", GUARDS)
def test_a_path_that_raises_is_switched_off_loudly_and_the_model_serves_exactly(case, tiny_model_dirs, plain_tiny,
                                                                               monkeypatch, caplog):
    target, path, fallback = GUARDS[case]
    replacement = _only_packed(models.forward.forward_logits) if target == "forward_logits" else _boom
    monkeypatch.setattr(models.selfcheck, target, replacement)
    with caplog.at_level(logging.WARNING, logger="genscore.models"):
        loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)
    monkeypatch.undo()  # serving runs the real functions, under the plan the check left
    check = next(c for c in loaded.plan.checks if c.name == path)
    assert not check.enabled and "simulated failure" in check.reason, loaded.plan.as_dict()
    assert fallback(loaded.plan), loaded.plan.as_dict()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(path in message and "simulated failure" in message for message in warned), warned
    _assert_serves_exactly(loaded, plain_tiny)


def _assert_serves_exactly(loaded, plain) -> None:
    """Scoring of mixed lengths and three greedy decode steps, against the plain forward."""
    prompts = [list(range(3, 3 + n)) for n in (4, 19, 33)]
    got = forward_logits(loaded.model, loaded.plan, prompts, loaded.pad_token_id, [2, 2, 2])  # [6, V]
    want = torch.cat([position_logits(plain, p)[-2:] for p in prompts])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    hidden, batch = prefill(loaded.model, loaded.plan, prompts[:2], loaded.pad_token_id)
    rows = [head_logits(loaded.plan, hidden[:, -1])]
    for token in (7, 8):
        rows.append(decode_step(loaded.model, loaded.plan, batch, torch.tensor([token, token])))
    for b, prompt in enumerate(prompts[:2]):
        reference = position_logits(plain, prompt + [7, 8])[-3:]
        torch.testing.assert_close(torch.stack([r[b] for r in rows]), reference, atol=1e-4, rtol=0)


def test_an_unexpected_error_outside_any_check_still_loads_the_plain_path(tiny_model_dirs, plain_tiny, monkeypatch,
                                                                          caplog):
    """The layout step itself raising (not a check inside it): the step's paths stay off, the load goes on."""
    monkeypatch.setattr(models.selfcheck, "_layout", _boom)
    with caplog.at_level(logging.WARNING, logger="genscore.models"):
        loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)
    assert loaded.plan.layout == "one_at_a_time"
    assert any("packed_batches" in r.getMessage() and "simulated failure" in r.getMessage() for r in caplog.records)
    _assert_serves_exactly(loaded, plain_tiny)


def test_batch_invariance_that_raises_while_installing_is_switched_off(tiny_model_dirs, plain_tiny, monkeypatch,
                                                                       caplog):
    monkeypatch.setattr(models.selfcheck, "make_batch_invariant", _boom)
    with caplog.at_level(logging.WARNING, logger="genscore.models"):
        loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None,
                            batch_invariant=True)
    assert not loaded.plan.batch_invariant and not loaded.plan.enabled("batch_invariant")
    assert any("batch_invariant" in r.getMessage() and "simulated failure" in r.getMessage() for r in caplog.records)
    _assert_serves_exactly(loaded, plain_tiny)


def test_the_load_fails_in_plain_words_only_when_the_model_own_forward_fails(tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(models.selfcheck, "plain_logits", _boom)
    with pytest.raises(models.selfcheck.PlainForwardError, match="the model's own transformers forward fails"):
        load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)


def test_a_model_whose_paths_all_raise_is_served_over_http_by_the_plain_path(tiny_model_dirs, plain_tiny,
                                                                             monkeypatch):
    for target in ("prepack_linears", "use_packed_attention", "prefill_prefixes", "decode_step"):
        monkeypatch.setattr(models.selfcheck, target, _boom)
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)
    monkeypatch.undo()
    assert loaded.plan.prefix_reuse == "off" and loaded.plan.layout != "packed", loaded.plan.as_dict()
    settings = Settings(model="unused", served_model_name="llama", device="cpu", dtype="float32")
    with live_server(create_app(settings, loaded=loaded)) as url:
        card = httpx.get(f"{url}/v1/models").json()["data"][0]["fast_paths"]
        assert card["layout"] == loaded.plan.layout and card["decoding"] == loaded.plan.decoding
        off = {p["name"]: p["reason"] for p in card["paths"] if not p["enabled"]}
        assert "simulated failure" in off["prepacked_linears"] and "simulated failure" in off["batched_decoding"]
        prompt = list(range(3, 30))
        answer = httpx.post(f"{url}/score", json={"query": prompt, "label_token_ids": [5, 9]}, timeout=60).json()
        want = position_logits(plain_tiny, prompt)[-1].log_softmax(-1)[[5, 9]].tolist()
        assert answer["data"][0]["label_logprobs"] == pytest.approx(want, abs=1e-4)
