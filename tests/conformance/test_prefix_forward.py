"""models/prefix.py on the tiny models: rows over one or several prefixes, of any suffix length (empty included),
give the logits of a plain forward pass of each full sequence, packed (the default the self-check turns on) and one
padded row per suffix."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import models.forward
import models.packed
import models.prefix
from models import load_model
from models.head import head_logits
from models.prefix import (
    SuffixRow,
    forward_suffixes,
    prefill_prefixes,
    prefill_with_suffixes,
    supports_prefix_reuse,
)
from tests.reference import position_logits


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def loaded(request, tiny_model_dirs):
    return load_model(str(tiny_model_dirs[request.param]), "cpu", "float32")


@pytest.fixture
def plain(request, loaded, plain_models):
    """The plain transformers model of the same architecture: the reference."""
    return plain_models[request.node.callspec.params["loaded"]]


@pytest.fixture(params=["packed", "rows"])
def layout(request, loaded):
    """Suffixes packed after their prefix (what the self-check turned on), or one padded row per suffix."""
    assert loaded.plan.enabled("packed_suffixes"), loaded.plan.as_dict()
    checked = loaded.plan
    loaded.plan = replace(checked, packed_suffixes=request.param == "packed")  # a plan the test builds
    yield request.param
    loaded.plan = checked


def test_rows_over_several_prefixes_equal_full_passes(loaded, plain, layout):
    assert supports_prefix_reuse(loaded.model)
    generator = torch.Generator().manual_seed(0)
    short, long = (torch.randint(3, 300, (n,), generator=generator).tolist() for n in (5, 13))
    short_state, long_state = prefill_prefixes(loaded.model, loaded.plan, [short, long], loaded.pad_token_id)
    assert short_state.keys[0].shape[-2] == 5 and long_state.keys[0].shape[-2] == 13
    cases = [(short_state, short, [7, 8, 9], 3), (long_state, long, [11], 2), (short_state, short, [], 1),
             (long_state, long, [12, 13, 14, 15, 16, 17], 4), (long_state, long, [], 1)]
    rows = [SuffixRow(state, tuple(suffix), keep) for state, _, suffix, keep in cases]
    got = head_logits(loaded.plan, forward_suffixes(loaded.model, loaded.plan, rows, loaded.pad_token_id))
    expected = torch.cat([position_logits(plain, prefix + suffix)[-keep:] for _, prefix, suffix, keep in cases])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # one prefix for every row: the states are expanded, not copied
    rows = [SuffixRow(short_state, (5, 6), 1), SuffixRow(short_state, (8,), 2)]
    got = head_logits(loaded.plan, forward_suffixes(loaded.model, loaded.plan, rows, loaded.pad_token_id))
    expected = torch.cat([position_logits(plain, short + [5, 6])[-1:], position_logits(plain, short + [8])])
    torch.testing.assert_close(got, expected[[0, -2, -1]], atol=1e-4, rtol=0)


def test_keep_beyond_the_suffix_is_refused(loaded):
    (state,) = prefill_prefixes(loaded.model, loaded.plan, [[5, 6, 7]], loaded.pad_token_id)
    with pytest.raises(ValueError, match="keep"):
        forward_suffixes(loaded.model, loaded.plan, [SuffixRow(state, (1,), 3)], loaded.pad_token_id)


def test_packed_suffixes_beyond_one_call_are_split_and_equal_full_passes(loaded, plain, layout, monkeypatch):
    monkeypatch.setattr(models.forward, "PACK_TOKENS", 5)  # 4 suffixes of 2-4 tokens: several calls (float32)
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 300, (9,), generator=generator).tolist()
    suffixes = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (3, 2, 4, 3)]
    (state,) = prefill_prefixes(loaded.model, loaded.plan, [prefix], loaded.pad_token_id)
    keeps = [4, 1, 2, 3]
    rows = [SuffixRow(state, tuple(s), k) for s, k in zip(suffixes, keeps)]
    got = head_logits(loaded.plan, forward_suffixes(loaded.model, loaded.plan, rows, loaded.pad_token_id))
    expected = torch.cat([position_logits(plain, prefix + s)[-k:] for s, k in zip(suffixes, keeps)])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("group_tokens", [1, 6])
def test_packed_suffix_attention_in_groups_equals_full_passes(loaded, plain, monkeypatch, group_tokens):
    """Packed attention splits the suffixes' queries into groups (each alone, or merged, here) over the prefix
    states plus the group's own keys: still each suffix's plain-pass logits."""
    assert loaded.plan.enabled("packed_suffixes"), loaded.plan.as_dict()
    monkeypatch.setattr(models.packed, "SUFFIX_GROUP_TOKENS", group_tokens)
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 300, (7,), generator=generator).tolist()
    suffixes = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (3, 0, 2, 4, 3)]
    (state,) = prefill_prefixes(loaded.model, loaded.plan, [prefix], loaded.pad_token_id)
    keeps = [3, 1, 2, 4, 1]
    rows = [SuffixRow(state, tuple(s), k) for s, k in zip(suffixes, keeps)]
    got = head_logits(loaded.plan, forward_suffixes(loaded.model, loaded.plan, rows, loaded.pad_token_id))
    expected = torch.cat([position_logits(plain, prefix + s)[-k:] for s, k in zip(suffixes, keeps)])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_several_prefixes_prefill_in_one_call_and_their_suffixes_share_one(loaded, plain):
    """Packed: prefixes of different lengths are prefilled back to back in one call (no padding), and the suffixes
    hanging off all of them run in one more call, each seeing only its own prefix: still the plain-pass logits."""
    assert loaded.plan.enabled("packed_suffixes"), loaded.plan.as_dict()
    calls = []  # the [B, T] of each model call
    hook = _model_calls(loaded.model, calls)
    generator = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (4, 9, 6)]
    try:
        states = prefill_prefixes(loaded.model, loaded.plan, prefixes, loaded.pad_token_id)
        assert calls == [(1, 19)]
        cases = [(1, [7, 8], 3), (0, [9], 1), (2, [10, 11, 12], 2), (1, [], 1), (0, [13, 14, 15, 16], 4), (2, [5], 2)]
        rows = [SuffixRow(states[p], tuple(suffix), keep) for p, suffix, keep in cases]
        got = head_logits(loaded.plan, forward_suffixes(loaded.model, loaded.plan, rows, loaded.pad_token_id))
        assert calls == [(1, 19), (1, 11)]
    finally:
        hook.remove()
    for state, prefix in zip(states, prefixes):
        assert state.tokens == tuple(prefix) and state.keys[0].shape[-2] == len(prefix)
    expected = torch.cat([position_logits(plain, prefixes[p] + suffix)[-keep:] for p, suffix, keep in cases])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def _model_calls(model, calls: list):
    """Record the [B, T] of every call of the model's body into `calls`; returns the hook to remove."""
    return model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)


@pytest.mark.parametrize("pack_tokens", [1024, 12])
def test_prefixes_prefilled_with_their_suffixes_equal_full_passes(loaded, plain, layout, monkeypatch, pack_tokens):
    """prefill_with_suffixes: packed, each prefix runs in the same call as the suffixes that fit after it (all in
    one call here; with 12 tokens a call, some suffixes run over the prefix's states after); one padded row per
    suffix, the prefixes are prefilled first. The prefixes' states and every kept position are the plain pass's."""
    monkeypatch.setattr(models.forward, "PACK_TOKENS", pack_tokens)
    generator = torch.Generator().manual_seed(4)
    prefixes = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (5, 8, 3)]
    rows = [(1, [7, 8, 9], 2), (0, [11], 2), (2, [], 1), (1, [12, 13, 14, 15], 5), (0, [5, 6], 1), (2, [44, 45], 3)]
    calls = []
    hook = _model_calls(loaded.model, calls)
    try:
        states, hidden = prefill_with_suffixes(loaded.model, loaded.plan, prefixes, rows, loaded.pad_token_id)
    finally:
        hook.remove()
    if layout == "packed" and pack_tokens == 1024:
        assert calls == [(1, 28)]
    elif layout == "packed":
        assert calls == [(1, 8), (1, 11), (1, 5), (1, 4)]  # each prefix with the suffixes that fit; one later
    got = head_logits(loaded.plan, hidden)
    expected = torch.cat([position_logits(plain, prefixes[p] + suffix)[-keep:] for p, suffix, keep in rows])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    alone = prefill_prefixes(loaded.model, loaded.plan, prefixes, loaded.pad_token_id)
    for state, prefix, reference in zip(states, prefixes, alone):
        assert state.tokens == tuple(prefix)
        torch.testing.assert_close(state.keys[-1], reference.keys[-1], atol=1e-5, rtol=0)
        torch.testing.assert_close(state.last_hidden, reference.last_hidden, atol=1e-5, rtol=0)


def test_a_prefix_longer_than_a_call_is_prefilled_alone(loaded, plain, monkeypatch):
    """A prefix after which no suffix fits in a call is prefilled on its own (no mask over the row); its suffixes
    and the ones that did not fit after theirs run over the states after: still the plain pass's logits."""
    assert loaded.plan.enabled("packed_suffixes"), loaded.plan.as_dict()
    monkeypatch.setattr(models.forward, "PACK_TOKENS", 6)  # float32: 6 tokens a call
    generator = torch.Generator().manual_seed(5)
    prefixes = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (9, 4)]
    rows = [(0, [7, 8], 2), (1, [9, 10], 3), (1, [11], 1)]
    calls = []  # (tokens, dimensions of the attention mask) of each model call
    hook = loaded.model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((kwargs["input_ids"].shape[1], kwargs["attention_mask"].dim())),
        with_kwargs=True)
    try:
        _, hidden = prefill_with_suffixes(loaded.model, loaded.plan, prefixes, rows, loaded.pad_token_id)
    finally:
        hook.remove()
    # the long prefix alone (a plain 2D mask of ones); the short one with a suffix; the rest over the states
    assert calls == [(9, 2), (6, 4), (3, 4)]
    expected = torch.cat([position_logits(plain, prefixes[p] + suffix)[-keep:] for p, suffix, keep in rows])
    torch.testing.assert_close(head_logits(loaded.plan, hidden), expected, atol=1e-4, rtol=0)
