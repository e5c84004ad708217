"""models/compiled.py on the tiny Llama in float32: compiled decoder layers give the plain forward's logits on packed
calls, share one graph across layers and lengths, run the eager forward's fused linears and packed-attention kernel
inside that graph, and leave calls with a key/value cache eager."""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from models import load_model
from models.attention_cpu import CPU_VARLEN
from models.compiled import INDUCTOR_CACHE, compile_layers, is_compiled, uncompile_layers
from models.forward import forward_logits
from models.head import head_logits
from models.prefix import SuffixRow, forward_suffixes, prefill_prefixes
from models.selfcheck import NOT_COMPILED_WHEN_INVARIANT
from tests.reference import position_logits


@pytest.fixture(scope="module")
def compiled(tiny_model_dirs, tmp_path_factory):
    torch._dynamo.reset()
    counters.clear()
    with pytest.MonkeyPatch.context() as patch:  # inductor's cache in a folder of this test's own
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        loaded = load_model(str(tiny_model_dirs["llama"]), "cpu", "float32", compile=True)
        yield loaded
    uncompile_layers(loaded.model)


def _op_calls(run) -> dict[str, int]:
    """How many times `run` calls each op, by name."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    calls: dict[str, int] = {}
    for event in prof.events():
        calls[event.name] = calls.get(event.name, 0) + 1
    return calls


def _compiled_regions(run) -> int:
    """How many compiled-graph calls `run` makes."""
    return sum(n for name, n in _op_calls(run).items() if name.startswith("Torch-Compiled Region"))


def test_compiled_layers_pass_the_self_check(compiled):
    assert compiled.plan.enabled("compiled_layers"), compiled.plan.as_dict()
    assert is_compiled(compiled.model)


def test_packed_calls_run_compiled_and_equal_the_plain_forward(compiled, plain_models):
    plain = plain_models["llama"]
    generator = torch.Generator().manual_seed(3)
    for lengths in ((5, 17, 9), (31,), (2, 3, 40, 12, 7)):
        sequences = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in lengths]
        keep = [min(3, n) for n in lengths]
        got = []

        def run(sequences=sequences, keep=keep, got=got):
            got.append(forward_logits(compiled.model, compiled.plan, sequences, 0, keep))

        assert _compiled_regions(run) == compiled.model.config.num_hidden_layers  # one call per layer, one pack
        expected = torch.cat([position_logits(plain, seq)[-k:] for seq, k in zip(sequences, keep)])
        torch.testing.assert_close(got[0], expected, atol=1e-4, rtol=0)
    # every layer and every pack length above ran the one graph
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compiled_layers_keep_the_fused_linears_and_the_attention_kernel(compiled):
    """The graph calls the fused groups' one GEMM (not each linear) and, where the plan has it, the packed-attention
    kernel once per layer (not one SDPA call per prompt)."""
    assert compiled.plan.enabled("fused_linears"), compiled.plan.as_dict()
    sequences = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    calls = _op_calls(lambda: forward_logits(compiled.model, compiled.plan, sequences, 0))
    layers = compiled.model.config.num_hidden_layers
    kernels = ("genscore_cpu::packed_linear", "mkldnn::_linear_pointwise")  # genscore's linear or oneDNN's
    linear_calls = sum(n for name, n in calls.items() if name in kernels)
    assert linear_calls == 4 * layers + 1, calls  # query/key/value, output, gate/up, down; the head
    if compiled.plan.attention_kernel != CPU_VARLEN:
        pytest.skip(f"the CPU attention kernel is not this machine's plan ({compiled.plan.attention_kernel})")
    assert calls.get("genscore_cpu::varlen_attention") == layers, calls
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in calls, calls


def test_calls_with_a_cache_stay_eager(compiled, plain_models):
    plain = plain_models["llama"]
    prefix, suffixes = [5, 6, 7, 8, 9, 10], [(11, 12), (13,)]
    got = []

    def run():
        (state,) = prefill_prefixes(compiled.model, compiled.plan, [prefix], 0)
        rows = [SuffixRow(state, suffix, 1) for suffix in suffixes]
        got.append(head_logits(compiled.plan, forward_suffixes(compiled.model, compiled.plan, rows, 0)))

    assert _compiled_regions(run) == 0
    expected = torch.stack([position_logits(plain, prefix + list(suffix))[-1] for suffix in suffixes])
    torch.testing.assert_close(got[0], expected, atol=1e-4, rtol=0)


def test_compile_keeps_inductor_cache_under_the_cache_dir(tiny_loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset")  # so that undoing the next line restores the original
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    try:
        assert compile_layers(tiny_loaded.model, tmp_path)  # compiles lazily: nothing runs here
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / INDUCTOR_CACHE)
    finally:
        uncompile_layers(tiny_loaded.model)
    assert not is_compiled(tiny_loaded.model)


def test_a_one_token_pack_runs_eager(compiled, plain_models):
    got = []
    assert _compiled_regions(lambda: got.append(forward_logits(compiled.model, compiled.plan, [[42]], 0))) == 0
    torch.testing.assert_close(got[0], position_logits(plain_models["llama"], [42])[-1:], atol=1e-4, rtol=0)


def test_compile_is_not_combined_with_batch_invariance(tiny_model_dirs):
    loaded = load_model(str(tiny_model_dirs["llama"]), "cpu", "float32", compile=True, batch_invariant=True)
    check = next(c for c in loaded.plan.checks if c.name == "compiled_layers")
    assert not check.enabled and check.reason == NOT_COMPILED_WHEN_INVARIANT
    assert not is_compiled(loaded.model) and loaded.plan.batch_invariant
