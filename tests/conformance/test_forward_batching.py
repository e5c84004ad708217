"""forward_logits on mixed lengths, packed and padded: neither may change rows, their order, or keep_last's layout."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import models.forward
from models import load_model
from models.cpu_features import bfloat16_packing_missing
from models.forward import PACK_TOKENS, forward_logits, pack_tokens, plan_micro_batches, plan_packs
from models.head import head_logits
from models.prepack import PrepackedLinear

LENGTHS = (3, 60, 5, 61, 4, 90, 2, 58)
KEEP = [1, 2, 1, 3, 2, 1, 1, 2]


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def arch_models(request, tiny_model_dirs):
    """(served, plain): the same tiny model with genscore's serving kernels, and exactly as transformers loads it."""
    folder = str(tiny_model_dirs[request.param])
    return load_model(folder, "cpu", "float32"), load_model(folder, "cpu", "float32", optimize=False)


def _sequences(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]


def _alone(model, seq: list[int], keep: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([seq])).logits[0, -keep:].float()  # [keep, V]


def test_plan_packs_keeps_order_and_budget():
    assert plan_packs([3, 4, 5, 10, 2], 10) == [[0, 1], [2], [3], [4]]
    assert plan_packs([30], 10) == [[0]]  # a sequence longer than the budget packs alone
    assert plan_packs([], 10) == []


@pytest.mark.parametrize("pack_tokens", [1024, 100])  # one pack, and several
def test_packed_rows_match_each_sequence_alone_in_caller_order(arch_models, pack_tokens, monkeypatch):
    served, plain = arch_models
    assert served.plan.layout == "packed"
    monkeypatch.setattr(models.forward, "PACK_TOKENS", pack_tokens)
    sequences = _sequences(served.vocab_size)
    got = forward_logits(served.model, served.plan, sequences, served.pad_token_id, keep_last=KEEP)  # [sum(KEEP), V]
    expected = torch.cat([_alone(plain.model, s, k) for s, k in zip(sequences, KEEP)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    last_only = forward_logits(served.model, served.plan, sequences, served.pad_token_id)  # [B, V]
    torch.testing.assert_close(last_only, expected[torch.tensor(KEEP).cumsum(0) - 1], atol=1e-5, rtol=0)


def test_padded_micro_batches_match_each_sequence_alone_in_caller_order(arch_models):
    """Models that cannot pack (not SDPA) take padded micro-batches of similar length: a plan a test builds."""
    _, plain = arch_models
    assert plain.plan.layout == "one_at_a_time"  # loaded plain: each sequence alone
    plan = replace(plain.plan, layout="padded")
    sequences = _sequences(plain.vocab_size)
    assert len(plan_micro_batches([len(s) for s in sequences])) > 1  # the case under test: several calls
    got = forward_logits(plain.model, plan, sequences, plain.pad_token_id, keep_last=KEEP)
    expected = torch.cat([_alone(plain.model, s, k) for s, k in zip(sequences, KEEP)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0)])
def test_prepacked_linear_matches_nn_linear(dtype, tol):
    if dtype == torch.bfloat16 and (missing := bfloat16_packing_missing()) is not None:
        # the loader's fallback on such a CPU is tested everywhere: tests/api/test_bfloat16.py forces it
        pytest.skip(f"oneDNN cannot pack bfloat16 weights on this CPU: {missing}")
    torch.manual_seed(0)
    for bias in (True, False):
        linear = torch.nn.Linear(96, 80, bias=bias).to(dtype)
        x = torch.randn(2, 7, 96).to(dtype)  # [B, T, in]: any leading shape
        with torch.inference_mode():
            got, expected = PrepackedLinear(linear)(x), linear(x)
        assert got.shape == expected.shape == (2, 7, 80)
        # bfloat16: the same oneDNN kernel either way, so bit-identical; float32 may sum in another order.
        torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=0)


def test_serving_kernels_leave_lm_head_and_embeddings_alone(tiny_loaded):
    model = tiny_loaded.model
    prepacked = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    assert prepacked and not isinstance(model.get_output_embeddings(), PrepackedLinear)
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_the_output_head_runs_a_prepacked_copy_of_lm_head(tiny_loaded, monkeypatch):
    model, plan = tiny_loaded.model, tiny_loaded.plan
    packed = plan.held_head
    assert isinstance(packed, PrepackedLinear)  # on top of the model's own lm_head, which stays plain
    calls = []
    real = PrepackedLinear.forward

    def spy(self, x):
        calls.append(self)
        return real(self, x)

    monkeypatch.setattr(PrepackedLinear, "forward", spy)
    hidden = torch.randn(5, model.config.hidden_size)  # [N, H]
    with torch.inference_mode():
        got = head_logits(plan, hidden)  # [N, V]
        expected = model.get_output_embeddings()(hidden).float()
    assert calls == [packed]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_half_precision_packs_twice_the_tokens_per_call(tiny_model_dirs):
    loaded = load_model(str(tiny_model_dirs["llama"]), "cpu", "bfloat16")
    assert pack_tokens(loaded.model) == 2 * PACK_TOKENS
    calls = []
    hook = loaded.model.base_model.register_forward_hook(lambda _m, args, kwargs, out: calls.append(1),
                                                         with_kwargs=True)
    sequences = [list(range(3, 3 + 60)) for _ in range(25)]  # 1500 tokens: two float32-sized packs, one here
    try:
        forward_logits(loaded.model, loaded.plan, sequences, loaded.pad_token_id)
    finally:
        hook.remove()
    assert len(calls) == 1
