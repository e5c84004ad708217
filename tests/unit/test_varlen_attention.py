"""The varlen implementation of the packed-attention op, run on CPU through a stand-in for torch's varlen_attn that
computes what flash attention's varlen kernel computes: the plumbing around it (layouts, windows, GQA, refusals,
the self-check that switches it off) gives the plain forward's numbers, or is switched off."""

from __future__ import annotations

import pytest
import torch

import models.attention_cuda as attention_cuda
from models.attention_cpu import CPU_VARLEN
from models.forward import forward_logits
from models.op_count import OpCounter
from models.packed import LOOP
from models.selfcheck import install_fast_paths
from tests.unit.packed_attention_cases import (
    assert_shared_prefixes_give_the_plain_forward,
    attention_model,
    packed_plan,
    plain_last_logits,
    sample_prompts,
)

pytestmark = pytest.mark.unit

PARAMS = frozenset({"scale", "window_size", "enable_gqa"})


def _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                  honour_window=True):
    """What flash attention's varlen kernel computes: per segment, its queries aligned to the end of its keys (a
    segment of Lq queries over Lk keys puts query i at key position i + Lk - Lq), query i sees key j when
    i' - left <= j <= i' + right for that position i' (a negative bound is no bound).
    q [Tq, H, D]; k, v [Tk, H_kv, D] -> [Tq, H, D]."""
    assert q.shape[1] == k.shape[1] or enable_gqa
    left, right = window_size if honour_window else (-1, 0)
    out = torch.empty_like(q)
    # the stand-in reads the boundaries on the host; the real kernel reads them on the device
    q_bounds, k_bounds = cu_q.numpy().tolist(), cu_k.numpy().tolist()
    for a, b, c, d in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:]):
        qs, ks, vs = q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)  # [H, L, D]
        ks = ks.repeat_interleave(qs.shape[0] // ks.shape[0], 0)
        vs = vs.repeat_interleave(qs.shape[0] // vs.shape[0], 0)
        i = torch.arange(b - a)[:, None] + (d - c) - (b - a)  # each query's position among the keys
        j = torch.arange(d - c)[None]
        sees = torch.ones(b - a, d - c, dtype=torch.bool)
        if right >= 0:
            sees &= j <= i + right
        if left >= 0:
            sees &= j >= i - left
        scores = qs @ ks.transpose(1, 2) * (scale if scale is not None else qs.shape[-1] ** -0.5)  # [H, Lq, Lk]
        out[a:b] = (scores.masked_fill(~sees, float("-inf")).softmax(-1) @ vs).transpose(0, 1)
    return out


@pytest.fixture
def on_cpu(monkeypatch):
    """Let the varlen kernel run on CPU in float32 through the stand-in."""
    monkeypatch.setattr(attention_cuda, "_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(attention_cuda, "_DTYPES", (torch.float32,))
    monkeypatch.setattr(attention_cuda, "_varlen", lambda: (_flash_varlen, PARAMS))
    return monkeypatch


def _spy_on(monkeypatch, name: str) -> list[bool]:
    """Record, per call of attention_cuda.`name`, whether the kernel ran (it returns None where it refuses)."""
    calls = []
    real = getattr(attention_cuda, name)

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(attention_cuda, name, spy)
    return calls

@pytest.mark.parametrize("window", [None, 8], ids=["causal", "sliding"])
def test_varlen_kernel_gives_the_plain_forward(on_cpu, window):
    model = attention_model(window)
    prompts = sample_prompts()
    expected = plain_last_logits(model, prompts)
    plan = packed_plan(model, attention_cuda.VARLEN)
    calls = _spy_on(on_cpu, "segment_attention_fast")
    got = forward_logits(model, plan, prompts, 0)
    assert calls and all(calls), "every layer ran the varlen kernel"
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_varlen_makes_one_attention_op_per_layer_and_no_sync(on_cpu):
    model = attention_model(8, layers=6)
    plan = packed_plan(model, attention_cuda.VARLEN)
    prompts = sample_prompts() * 6
    forward_logits(model, plan, prompts, 0)
    with OpCounter() as counter:
        forward_logits(model, plan, prompts, 0)
    assert counter.counts.kernel_names["segment_attention"] == 6
    assert counter.counts.syncs == 0, dict(counter.counts.sync_names)


def test_a_mask_without_a_window_is_refused(on_cpu):
    q = torch.randn(1, 4, 6, 16)
    kv = torch.randn(1, 2, 6, 16)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert attention_cuda.segment_attention_fast(attention_cuda.VARLEN, q, kv, kv, mask, cu, 4, 2, None, None) is None
    assert attention_cuda.segment_attention_fast(attention_cuda.VARLEN, q, kv, kv, None, cu, 4, 2, None, None) is not None


def _self_checked(model, batch_invariant: bool = False):
    return install_fast_paths(model, 300, 64, 0, batch_invariant=batch_invariant)


def test_the_self_check_keeps_a_kernel_that_agrees(on_cpu):
    plan = _self_checked(attention_model(8))
    assert plan.attention_kernel == attention_cuda.VARLEN and plan.enabled(attention_cuda.VARLEN_PATH)
    assert plan.as_dict()["attention_kernel"] == attention_cuda.VARLEN


def test_a_kernel_that_drops_the_window_is_switched_off(on_cpu):
    """The self-check's verdict decides: a varlen kernel that ignores the window disagrees and the loop stays."""
    on_cpu.setattr(attention_cuda, "_varlen",
                   lambda: (lambda *a, **k: _flash_varlen(*a, **k, honour_window=False), PARAMS))
    model = attention_model(8)
    prompts = sample_prompts()
    expected = plain_last_logits(model, prompts)
    plan = _self_checked(model)
    verdict = next(check for check in plan.checks if check.name == attention_cuda.VARLEN_PATH)
    assert not verdict.enabled and verdict.difference > 1e-2
    assert plan.attention_kernel == LOOP and plan.layout == "packed"
    torch.testing.assert_close(forward_logits(model, plan, prompts, 0), expected, atol=1e-4, rtol=0)


def test_varlen_is_refused_under_batch_invariance(on_cpu):
    plan = _self_checked(attention_model(8), batch_invariant=True)
    verdict = next(check for check in plan.checks if check.name == attention_cuda.VARLEN_PATH)
    assert not verdict.enabled and verdict.difference is None and "batch-invariant" in verdict.reason
    assert plan.attention_kernel == LOOP


def test_cpu_never_runs_the_cuda_kernel():
    """On CPU the one-call path is genscore's own kernel (tests/unit/test_cpu_varlen_attention.py), never varlen_attn."""
    plan = _self_checked(attention_model(None))
    assert plan.attention_kernel in (CPU_VARLEN, LOOP)


def test_varlen_is_refused_off_cuda_and_for_float32():
    assert attention_cuda.varlen_refusal(torch.device("cpu"), torch.bfloat16, 64) is not None
    assert attention_cuda.varlen_refusal(torch.device("cuda"), torch.float32, 64) is not None


def test_varlen_over_shared_prefixes_gives_the_plain_forward(on_cpu):
    """Packed suffixes through the varlen kernel over gathered keys give the plain forward's numbers."""
    calls = _spy_on(on_cpu, "spanned_attention_fast")
    model = attention_model(None)
    assert_shared_prefixes_give_the_plain_forward(model, packed_plan(model, attention_cuda.VARLEN))
    assert calls and all(calls), "every spanned call ran the varlen kernel"
