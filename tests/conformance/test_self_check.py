"""The load-time self-check catches a fast path that is wrong and switches it off; the served numbers stay right."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import models.fused_linears
import models.head
import models.packed
import models.prefix
import models.prepack
from models import forward_logits, load_model
from models.tiny import WINDOW, make_tiny_model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("selfcheck") / "mistral", "mistral", max_positions=256)


def paths_of(loaded) -> dict:
    return {check.name: check for check in loaded.plan.checks}


def last_logprobs(model, prompts) -> torch.Tensor:
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([p])).logits[0, -1].float().log_softmax(-1) for p in prompts])


def test_packing_that_drops_the_window_is_switched_off(mistral, monkeypatch):
    real = models.packed.sdpa_attention_forward

    def windowless(module, query, key, value, mask, **kwargs):  # the bug of a packed path that ignores the mask
        kwargs.pop("is_causal", None)
        return real(module, query, key, value, None, is_causal=True, **kwargs)

    monkeypatch.setattr(models.packed, "sdpa_attention_forward", windowless)
    loaded = load_model(str(mistral), device="cpu", dtype="float32", cache_dir=None)
    paths = paths_of(loaded)
    assert not paths["packed_batches"].enabled and paths["packed_batches"].difference > 1e-2
    assert paths["padded_batches"].enabled
    prompts = [list(range(3, 3 + n)) for n in (5, 4 * WINDOW, 9 * WINDOW)]
    plain = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    got = forward_logits(loaded.model, loaded.plan, prompts, loaded.pad_token_id).log_softmax(-1)
    assert (got - last_logprobs(plain, prompts)).abs().max().item() < 1e-4


def test_prepacked_linears_that_disagree_are_put_back(mistral, monkeypatch):
    real = models.prepack.PrepackedLinear.forward
    monkeypatch.setattr(models.prepack.PrepackedLinear, "forward", lambda self, x: real(self, x) * 1.01)
    loaded = load_model(str(mistral), device="cpu", dtype="float32", cache_dir=None)
    assert not paths_of(loaded)["prepacked_linears"].enabled
    assert not any(isinstance(m, models.prepack.PrepackedLinear) for m in loaded.model.modules())
    assert loaded.plan.held_head is None


def test_fused_linears_that_disagree_are_put_back(mistral, monkeypatch):
    real = models.fused_linears.FusedGroup.slice_for

    def last_slice_off(self, x, index, *tensors):  # the bug of a group that misplaces one member's columns
        out = real(self, x, index, *tensors)
        return out.roll(1, dims=-1) if index == len(self.sizes) - 1 else out

    monkeypatch.setattr(models.fused_linears.FusedGroup, "slice_for", last_slice_off)
    loaded = load_model(str(mistral), device="cpu", dtype="float32", cache_dir=None)
    paths = paths_of(loaded)
    assert not paths["fused_linears"].enabled and paths["fused_linears"].difference > 1e-2
    assert paths["prepacked_linears"].enabled
    assert not any(isinstance(m, models.fused_linears.FusedMember) for m in loaded.model.modules())
    prompts = [list(range(3, 3 + n)) for n in (5, 2 * WINDOW)]
    plain = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    got = forward_logits(loaded.model, loaded.plan, prompts, loaded.pad_token_id).log_softmax(-1)
    assert (got - last_logprobs(plain, prompts)).abs().max().item() < 1e-4


def test_a_prepacked_head_that_disagrees_is_put_back(mistral, monkeypatch):
    real = models.prepack.PrepackedLinear.forward

    def wrong_head(self, x):  # right for the body's linears, wrong for lm_head only
        out = real(self, x)
        return out * 1.01 if self.out_features == loaded_vocab else out

    loaded_vocab = AutoModelForCausalLM.from_pretrained(mistral).get_output_embeddings().out_features
    monkeypatch.setattr(models.prepack.PrepackedLinear, "forward", wrong_head)
    loaded = load_model(str(mistral), device="cpu", dtype="float32", cache_dir=None)
    assert not paths_of(loaded)["prepacked_linears"].enabled
    assert loaded.plan.held_head is None
    prompts = [list(range(3, 3 + n)) for n in (5, 2 * WINDOW)]
    plain = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    got = forward_logits(loaded.model, loaded.plan, prompts, loaded.pad_token_id).log_softmax(-1)
    assert (got - last_logprobs(plain, prompts)).abs().max().item() < 1e-4


def test_a_head_that_disagrees_fails_the_load(mistral, monkeypatch):
    real = models.head.given_hidden
    monkeypatch.setattr(models.head, "given_hidden", lambda *a, inputs_embeds, **k: real(inputs_embeds=inputs_embeds * 1.01))
    with pytest.raises(RuntimeError, match="cannot read this model's logits"):
        load_model(str(mistral), device="cpu", dtype="float32", cache_dir=None)


def test_a_prefix_and_suffixes_call_that_misplaces_its_rows_switches_packed_suffixes_off(tiny_model_dirs, monkeypatch):
    """The call that runs prefixes together with their suffixes is part of the packed_suffixes check: one that hands
    back its kept positions in the wrong order is caught at load, and packed suffixes go off."""
    real = models.prefix._prefix_and_suffixes_pass

    def misordered(model, plan, prefixes, suffixes):
        return [(state, hidden.flip(0)) for state, hidden in real(model, plan, prefixes, suffixes)]

    monkeypatch.setattr(models.prefix, "_prefix_and_suffixes_pass", misordered)
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)
    paths = paths_of(loaded)
    assert paths["shared_prefix"].enabled
    assert not paths["packed_suffixes"].enabled and paths["packed_suffixes"].difference > 1e-2
