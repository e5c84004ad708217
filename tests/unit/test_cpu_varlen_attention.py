"""The CPU implementation of the packed-attention op (models/attention_cpu.py, built for this CPU): the same numbers
as one SDPA call per segment, in one call per layer; what it refuses; and the self-check that switches it off when
it disagrees or cannot be built."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import models.attention_cpu as attention_cpu
import models.packed as packed
from models.attention_cuda import VARLEN_PATH
from models.forward import forward_logits
from models.packed import LOOP
from models.selfcheck import install_fast_paths
from tests.unit.packed_attention_cases import (
    assert_shared_prefixes_give_the_plain_forward,
    attention_model,
    packed_plan,
    plain_last_logits,
    require_cpu_kernels,
    sample_prompts,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kernel():
    require_cpu_kernels()
    return torch.ops.genscore_cpu.varlen_attention


def _reference(q, k, v, bounds, window, scale=None):
    """One SDPA call per segment in float64: q [T, H, D], k, v [T, H_kv, D] -> [T, H, D]."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1).double() for t in (q, k, v))  # [H, L, D]
        length = b - a
        i, j = torch.arange(length)[:, None], torch.arange(length)[None]
        sees = j <= i if window is None else (j <= i) & (j > i - window)
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=sees, scale=scale,
                                               enable_gqa=True).transpose(0, 1)
    return out


LENGTHS = (1, 5, 16, 17, 40, 63, 64, 65, 130, 3)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("window", [None, 7], ids=["causal", "sliding"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_the_kernel_is_per_segment_attention_in_float32(kernel, head_dim, window, kv_heads):
    bounds = [0]
    for length in LENGTHS:
        bounds.append(bounds[-1] + length)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(bounds[-1], 4, head_dim, generator=generator) * 2  # [T, H, D]
    k = torch.randn(bounds[-1], kv_heads, head_dim, generator=generator) * 2
    v = torch.randn(bounds[-1], kv_heads, head_dim, generator=generator)
    got = kernel(q, k, v, torch.tensor(bounds, dtype=torch.int32), None, head_dim ** -0.5, window or 0, 0)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(q, k, v, bounds, window), atol=1e-5, rtol=0)


def test_the_kernel_reads_strided_layouts_and_bfloat16(kernel):
    """The layer's own layout (tokens, then heads, strided) and bfloat16, within bfloat16's rounding of the output."""
    bounds = [0, 30, 31, 95]
    q = torch.randn(1, bounds[-1], 6, 32).transpose(1, 2)[0].transpose(0, 1)  # [T, H, D], strided as in a layer
    k = torch.randn(bounds[-1], 2, 32)
    v = torch.randn(bounds[-1], 2, 32)
    got = kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.tensor(bounds), None, 0.2, 0, 0)
    expected = _reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), bounds, None, 0.2)
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=0)


def test_bfloat16_results_are_the_float32_ones_rounded_to_nearest_even(kernel):
    """bfloat16 inputs are summed in float32 exactly as float32 inputs of the same values are, and each result is
    rounded as torch rounds float32 to bfloat16; a query that holds NaN gives NaN."""
    generator = torch.Generator().manual_seed(5)
    bounds = torch.tensor([0, 7, 40, 41, 90])
    q, k, v = (torch.randn(90, heads, 64, generator=generator).bfloat16() for heads in (6, 2, 2))  # [T, H, D]
    q[3, 1, 5] = float("nan")
    got = kernel(q, k, v, bounds, None, 0.125, 0, 0)
    in_float32 = kernel(q.float(), k.float(), v.float(), bounds, None, 0.125, 0, 0).bfloat16()
    nan = in_float32.isnan()
    assert nan[3, 1].all() and nan.sum() == 64 and got.isnan().equal(nan)
    assert torch.equal(got.view(torch.int16)[~nan], in_float32.view(torch.int16)[~nan])


def test_a_segment_gives_the_same_bits_whatever_its_neighbours(kernel):
    """Each query reads only its own segment's keys, in an order fixed by its own position."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(50, 4, 16, generator=generator) for _ in range(3))
    alone = kernel(q[10:50], k[10:50], v[10:50], torch.tensor([0, 40]), None, 0.25, 0, 0)
    batched = kernel(q, k, v, torch.tensor([0, 10, 50]), None, 0.25, 0, 0)
    assert torch.equal(alone, batched[10:50])


def test_what_the_kernel_does_not_serve_runs_the_loop(kernel):
    q = torch.randn(1, 4, 6, 16)
    kv = torch.randn(1, 2, 6, 16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    assert attention_cpu.segment_attention_cpu(q, kv, kv, None, cu, [0, 2, 6], None, None) is not None
    assert attention_cpu.segment_attention_cpu(q, kv, kv, mask, cu, [0, 2, 6], None, None) is None  # a mask it cannot read
    assert attention_cpu.segment_attention_cpu(q, kv, kv, mask, cu, [0, 2, 6], None, 8) is not None  # a sliding window
    assert attention_cpu.segment_attention_cpu(q.half(), kv.half(), kv.half(), None, cu, [0, 2, 6], None, None) is None
    assert attention_cpu.cpu_varlen_refusal(torch.device("cpu"), torch.float32, 48) is not None
    assert attention_cpu.cpu_varlen_refusal(torch.device("cpu"), torch.float16, 64) is not None
    assert attention_cpu.cpu_varlen_refusal(torch.device("cpu"), torch.bfloat16, 64) is None


def test_segments_over_the_bound_run_the_loop_in_the_same_row(kernel):
    """A long segment beside short ones: the kernel computes the short ones and leaves the long one to SDPA, which
    gives it the bits it gets alone; a row of long segments only runs the loop."""
    limit = attention_cpu.MAX_SEGMENT[attention_cpu.cpu_target()]
    lengths = [7, limit + 5, 30]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    tokens = bounds[-1]
    q, k, v = torch.randn(1, 4, tokens, 16), torch.randn(1, 2, tokens, 16), torch.randn(1, 2, tokens, 16)
    cu = torch.tensor(bounds, dtype=torch.int32)
    out, longer = attention_cpu.segment_attention_cpu(q, k, v, None, cu, bounds, None, None)
    assert longer == [(7, limit + 12)]
    row = packed.segment_attention(q, k, v, None, cu, bounds, max(lengths), 2, None, None, attention_cpu.CPU_VARLEN)
    loop = packed.segment_attention(q, k, v, None, cu, bounds, max(lengths), 2, None, None, LOOP)
    torch.testing.assert_close(row, loop, atol=1e-5, rtol=0)
    long_alone = [t[:, :, 7:limit + 12] for t in (q, k, v)]
    alone = packed.segment_attention(*long_alone, None, torch.tensor([0, limit + 5], dtype=torch.int32),
                                     [0, limit + 5], limit + 5, 2, None, None, attention_cpu.CPU_VARLEN)
    assert torch.equal(row[:, 7:limit + 12], alone)
    assert attention_cpu.segment_attention_cpu(*long_alone, None, cu[:2], [0, limit + 5], None, None) is None


@pytest.mark.parametrize("window", [None, 8], ids=["causal", "sliding"])
def test_the_kernel_gives_the_plain_forward_in_one_call_per_layer(kernel, window, monkeypatch):
    model = attention_model(window, layers=3)
    prompts = sample_prompts()
    plan = packed_plan(model, attention_cpu.CPU_VARLEN)
    ran = []  # per layer: whether the kernel served the call (it returns None where the loop runs)

    def spy(*args):
        out = attention_cpu.segment_attention_cpu(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(packed, "segment_attention_cpu", spy)
    torch.testing.assert_close(forward_logits(model, plan, prompts, 0), plain_last_logits(model, prompts), atol=1e-4, rtol=0)
    assert ran == [True] * 3


def _verdict(plan):
    return next(check for check in plan.checks if check.name == VARLEN_PATH)


def test_the_self_check_turns_the_kernel_on(kernel):
    plan = install_fast_paths(attention_model(8), 300, 64, 0)
    assert plan.attention_kernel == attention_cpu.CPU_VARLEN and _verdict(plan).enabled
    assert _verdict(plan).difference < 1e-4


def test_a_kernel_that_disagrees_is_switched_off(kernel, monkeypatch):
    """Break the kernel on purpose (it drops the sliding window): the self-check measures it and keeps the loop."""
    real = attention_cpu.segment_attention_cpu

    def drops_the_window(query, key, value, attention_mask, cu_seqlens, bounds, scaling, window):
        return real(query, key, value, None, cu_seqlens, bounds, scaling, None)

    monkeypatch.setattr(packed, "segment_attention_cpu", drops_the_window)
    model = attention_model(8)
    prompts = sample_prompts()
    plan = install_fast_paths(model, 300, 64, 0)
    assert not _verdict(plan).enabled and _verdict(plan).difference > 1e-2
    assert plan.attention_kernel == LOOP and plan.layout == "packed"
    torch.testing.assert_close(forward_logits(model, plan, prompts, 0), plain_last_logits(model, prompts), atol=1e-4, rtol=0)


def test_a_machine_that_cannot_build_it_keeps_the_loop(monkeypatch):
    monkeypatch.setattr(attention_cpu, "_built", {"error": "the CPU attention kernel could not be built: no g++"})
    plan = install_fast_paths(attention_model(None), 300, 64, 0)
    assert not _verdict(plan).enabled and "no g++" in _verdict(plan).reason
    assert plan.attention_kernel == LOOP and plan.layout == "packed"


def test_the_kernel_serves_batch_invariance(kernel):
    """A segment takes the kernel or the loop by its own length: the proof that a batch never moves a row holds with
    the kernel on."""
    plan = install_fast_paths(attention_model(None), 300, 64, 0, batch_invariant=True)
    assert _verdict(plan).enabled and plan.attention_kernel == attention_cpu.CPU_VARLEN
    assert plan.batch_invariant and plan.layout == "packed"


def test_spans_read_in_full_before_the_own_keys(kernel):
    """A segment reading a span of key rows (a shared prefix's, anywhere among the keys) then its own keys causally:
    the kernel against SDPA over those keys, aligned to the end (bottom-right causal)."""
    generator = torch.Generator().manual_seed(4)
    past, bounds, spans = 20, [0, 6, 6, 23], [[3, 20], [0, 0], [0, 9]]  # the middle segment is empty
    q = torch.randn(bounds[-1], 4, 16, generator=generator) * 2
    k = torch.randn(past + bounds[-1], 2, 16, generator=generator) * 2
    v = torch.randn(past + bounds[-1], 2, 16, generator=generator)
    got = kernel(q, k, v, torch.tensor(bounds), torch.tensor(spans), 0.25, 0, 0)
    for (a, b), (s, e) in zip(zip(bounds[:-1], bounds[1:]), spans):
        if a == b:
            continue
        keys = torch.cat([k[s:e], k[past + a:past + b]]).transpose(0, 1).double()  # [H_kv, span + L, D]
        values = torch.cat([v[s:e], v[past + a:past + b]]).transpose(0, 1).double()
        length, width = b - a, e - s + b - a
        sees = torch.arange(width)[None] <= torch.arange(length)[:, None] + (e - s)
        expected = F.scaled_dot_product_attention(q[a:b].transpose(0, 1).double(), keys, values, attn_mask=sees,
                                                  scale=0.25, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(got[a:b].double(), expected, atol=1e-5, rtol=0)


def test_the_kernel_over_shared_prefixes_gives_the_plain_forward(kernel, monkeypatch):
    """Packed suffixes through the kernel, their spans read in place, give the plain forward's numbers."""
    ran = []

    def spy(*args):
        out = attention_cpu.spanned_attention_cpu(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(packed, "spanned_attention_cpu", spy)
    model = attention_model(None)
    assert_shared_prefixes_give_the_plain_forward(model, packed_plan(model, attention_cpu.CPU_VARLEN))
    assert ran and all(ran), "every spanned call ran the kernel"


def test_a_spanned_kernel_that_disagrees_switches_packed_suffixes_off(kernel, monkeypatch):
    """Break the spanned calls on purpose (the span dropped): the self-check's packed-suffix check catches it."""
    real = attention_cpu.spanned_attention_cpu

    def drops_the_span(row, query, key, value, scaling):
        return real(replace(row, spans=tuple((s, s) for s, _ in row.spans)), query, key, value, scaling)

    monkeypatch.setattr(packed, "spanned_attention_cpu", drops_the_span)
    plan = install_fast_paths(attention_model(None), 300, 64, 0)
    assert plan.attention_kernel == attention_cpu.CPU_VARLEN
    verdict = next(check for check in plan.checks if check.name == "packed_suffixes")
    assert not verdict.enabled and not plan.packed_suffixes


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_waited_for(tmp_path):
    """torch's builder waits without end for its lock file to go: a start killed mid-build must not hang the next."""
    stale = tmp_path / "lock"
    stale.touch()
    long_ago = time.time() - attention_cpu.STALE_BUILD_S - 5
    os.utime(stale, (long_ago, long_ago))
    attention_cpu.clear_stale_lock(stale)
    assert not stale.exists()
    live = tmp_path / "live-lock"
    live.touch()
    threading.Timer(0.3, live.unlink).start()  # another process's build finishing
    started = time.monotonic()
    attention_cpu.clear_stale_lock(live, poll_s=0.05)
    assert time.monotonic() - started >= 0.25
