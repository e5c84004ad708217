"""Linears that read one input, run as one wider pre-packed GEMM: who is grouped, what each member hands back, and
the served numbers with the groups on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import forward_logits, load_model
from models.fused_linears import FusedGroup, FusedMember, find_groups, fuse_linears, restore_members
from models.prepack import PrepackedLinear
from tests.reference import last_logits, plain_model


class _Block(nn.Module):
    """q and k read the block's input, up reads q's output, and shared runs twice."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.up, self.shared = nn.Linear(8, 6), nn.Linear(8, 4, bias=False), nn.Linear(6, 5), \
            nn.Linear(8, 8)

    def forward(self, x):
        q = self.q(x)
        return q.sum() + self.k(x).sum() + self.up(q).sum() + self.shared(self.shared(x)).sum()


def _packed_block():
    block, originals = _Block(), {}
    for name, linear in list(block.named_children()):
        packed = PrepackedLinear(linear)
        setattr(block, name, packed)
        originals[id(packed)] = linear
    return block, originals


@pytest.fixture(autouse=True)
def _needs_packing():
    try:
        PrepackedLinear(nn.Linear(2, 2))
    except RuntimeError as exc:  # no oneDNN in this torch build
        pytest.skip(f"oneDNN packing is unavailable: {exc}")


def test_only_linears_called_once_on_one_input_are_grouped():
    block, _ = _packed_block()
    groups = find_groups(block, lambda: block(torch.randn(3, 8)))
    assert groups == [[(block, "q"), (block, "k")]]  # up reads another input; shared runs twice


def test_each_member_hands_back_its_own_linear_on_any_input():
    block, originals = _packed_block()
    swaps = fuse_linears([[(block, "q"), (block, "k")]], originals)
    assert isinstance(block.q, FusedMember) and isinstance(block.k, FusedMember)
    x, y = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    with torch.inference_mode():
        q_x, k_y, k_x = block.q(x), block.k(y), block.k(x)  # k called on another input than q: its own GEMM
        torch.testing.assert_close(q_x, originals[id(swaps[0][2])](x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_y, originals[id(swaps[1][2])](y), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_x, originals[id(swaps[1][2])](x), atol=1e-5, rtol=1e-5)
    assert block.q.group.last is None  # the last member in call order let go of the input and the output
    restore_members(swaps)
    assert type(block.q) is PrepackedLinear and type(block.k) is PrepackedLinear


def test_a_member_without_a_bias_adds_nothing():
    with_bias, without = nn.Linear(8, 3), nn.Linear(8, 2, bias=False)
    group = FusedGroup([with_bias, without])
    x = torch.randn(4, 8)
    with torch.inference_mode():
        tensors = group.packed_weight, group.bias
        torch.testing.assert_close(group.slice_for(x, 0, *tensors), with_bias(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(group.slice_for(x, 1, *tensors), without(x), atol=1e-5, rtol=1e-5)


def test_a_loaded_llama_runs_its_projections_fused_with_the_plain_numbers(tiny_model_dirs):
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)
    check = {c.name: c for c in loaded.plan.checks}["fused_linears"]
    assert check.enabled, check.reason
    members = [name for name, m in loaded.model.named_modules() if isinstance(m, FusedMember)]
    layers = loaded.model.config.num_hidden_layers
    assert len(members) == 5 * layers  # q, k, v; gate, up
    assert not any(name.endswith(("o_proj", "down_proj")) for name in members)
    prompts = [list(range(3, 3 + n)) for n in (4, 19, 40)]
    plain = plain_model(tiny_model_dirs["llama"])
    want = torch.stack([last_logits(plain, p).log_softmax(-1) for p in prompts])
    got = forward_logits(loaded.model, loaded.plan, prompts, loaded.pad_token_id).log_softmax(-1)
    assert (got - want).abs().max().item() < 1e-4


def test_batch_invariant_loads_keep_each_linear_alone(tiny_model_dirs):
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None,
                        batch_invariant=True)
    check = {c.name: c for c in loaded.plan.checks}["fused_linears"]
    assert not check.enabled and check.reason.startswith("batch-invariant")
    assert not any(isinstance(m, FusedMember) for m in loaded.model.modules())


def test_the_memory_model_counts_the_fused_weights_as_it_counted_the_linears(tiny_model_dirs, monkeypatch):
    import models.selfcheck
    from models.memory import MemoryModel

    fused = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)
    monkeypatch.setattr(models.selfcheck, "_fused", lambda checker, originals: None)
    alone = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)
    assert any(isinstance(m, FusedMember) for m in fused.model.modules())
    assert not any(isinstance(m, FusedMember) for m in alone.model.modules())
    assert MemoryModel.of(fused).weights_bytes == MemoryModel.of(alone).weights_bytes
