"""Cascade attention for packed suffixes (models/cascade.py): the same numbers as SDPA under the row's mask on random
inputs (grouped-query heads, several prefixes, spans into the row itself), the self-check that turns it on for a tiny
Llama and off where it is broken or cannot run, and the calls that take it building no mask."""

from __future__ import annotations

import logging

import pytest
import torch

import models.cascade
import models.prefix
from models import load_model
from models.head import head_logits
from models.packed import PackingUnsupported, _AttentionLayer, packed_row, packed_sdpa_attention
from models.prefix import SuffixRow, _Segments, forward_suffixes, prefill_with_suffixes
from models.tiny import make_tiny_model
from tests.reference import position_logits

pytestmark = pytest.mark.unit

HEADS, KV_HEADS, DIM = 4, 2, 16


def _attention(lengths, spans, past, cascade, dtype=torch.float32, seed=0, window=None):
    """packed_sdpa_attention over a row of segments of `lengths`, each reading its span of keys, after `past` key
    rows of states: [1, T, H, D]. The masked path gets the mask models/prefix.py builds for such a row."""
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    query = torch.randn(1, HEADS, tokens, DIM, generator=generator).to(dtype)
    key = torch.randn(1, KV_HEADS, past + tokens, DIM, generator=generator).to(dtype)
    value = torch.randn(1, KV_HEADS, past + tokens, DIM, generator=generator).to(dtype)
    segments = _Segments(lengths, spans, [0] * len(lengths))
    mask = None if cascade else segments.mask(past)[None, None]  # [1, 1, T, past + T]
    row = packed_row(torch.device("cpu"), "loop", lengths, spans, own_mask=True, past=past, cascade=cascade)
    assert row.cascade == cascade and row.key_index is None
    return packed_sdpa_attention(_AttentionLayer(HEADS // KV_HEADS), query, key, value, mask, packed_row=row,
                                 cu_seq_lens_q=segments.boundaries, scaling=DIM ** -0.5, sliding_window=window)[0]


# Suffixes over two prefixes' states (an empty suffix among them), and prefixes in the row with their suffixes.
ROWS = {
    "over states": ([5, 0, 3, 9, 1, 12], [(0, 7), (0, 7), (0, 7), (7, 20), (7, 20), (0, 7)], 20),
    "in the row": ([6, 4, 3, 11, 2, 5], [(0, 0), (0, 6), (0, 6), (0, 0), (13, 24), (13, 24)], 0),
}


@pytest.mark.parametrize("layout", ROWS)
def test_cascade_equals_the_masked_path_in_float32(layout):
    lengths, spans, past = ROWS[layout]
    masked = _attention(lengths, spans, past, cascade=False)
    cascade = _attention(lengths, spans, past, cascade=True)
    assert cascade.shape == masked.shape == (1, sum(lengths), HEADS, DIM)
    torch.testing.assert_close(cascade, masked, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ROWS)
def test_cascade_in_bfloat16_is_within_its_rounding(layout):
    """Both bfloat16 paths against the float32 result: the cascade rounds each part once more than one softmax, so
    it may differ by bfloat16 rounding, no more."""
    lengths, spans, past = ROWS[layout]
    exact = _attention(lengths, spans, past, cascade=False)
    masked = (_attention(lengths, spans, past, cascade=False, dtype=torch.bfloat16).float() - exact).abs().max()
    cascade = (_attention(lengths, spans, past, cascade=True, dtype=torch.bfloat16).float() - exact).abs().max()
    assert cascade <= 2 * masked + 2 ** -8, (cascade, masked)


def test_a_segment_over_its_prefix_alone_or_with_neighbours():
    """Only a segment's own span and tokens reach its result: the same segment next to others differs by rounding at
    most (the span's call holds more queries), never by what the neighbours hold."""
    alone = _attention([9], [(0, 20)], 20, cascade=True, seed=3)
    generator = torch.Generator().manual_seed(3)
    tokens, past = 9, 20
    query = torch.randn(1, HEADS, tokens, DIM, generator=generator)
    key = torch.randn(1, KV_HEADS, past + tokens, DIM, generator=generator)
    value = torch.randn(1, KV_HEADS, past + tokens, DIM, generator=generator)
    noise = torch.Generator().manual_seed(4)
    lengths, spans = [4, 9, 6], [(0, 20), (0, 20), (0, 20)]
    query = torch.cat([torch.randn(1, HEADS, 4, DIM, generator=noise), query, torch.randn(1, HEADS, 6, DIM, generator=noise)], 2)
    own = [torch.randn(1, KV_HEADS, 4, DIM, generator=noise), torch.randn(1, KV_HEADS, 6, DIM, generator=noise)]
    key = torch.cat([key[:, :, :past], own[0], key[:, :, past:], own[1]], 2)
    value = torch.cat([value[:, :, :past], own[0] * 2, value[:, :, past:], own[1] * 2], 2)
    row = packed_row(torch.device("cpu"), "loop", lengths, spans, own_mask=True, past=past, cascade=True)
    together = packed_sdpa_attention(_AttentionLayer(HEADS // KV_HEADS), query, key, value, None, packed_row=row,
                                     scaling=DIM ** -0.5)[0]
    torch.testing.assert_close(together[:, 4:13], alone, atol=1e-6, rtol=0)


def test_merge_by_lse_is_the_softmax_over_both_key_sets():
    generator = torch.Generator().manual_seed(1)
    scores, values = torch.randn(3, 10, generator=generator), torch.randn(10, 5, generator=generator)
    whole = scores.softmax(-1) @ values  # [3, 5]
    parts = [(scores[:, s].softmax(-1) @ values[s], scores[:, s].logsumexp(-1)) for s in (slice(0, 4), slice(4, 10))]
    torch.testing.assert_close(models.cascade.merge_by_lse(*parts[0], *parts[1]), whole, atol=1e-6, rtol=0)
    empty = torch.full((3,), float("-inf"))  # a part with no keys weighs nothing
    assert torch.equal(models.cascade.merge_by_lse(torch.zeros(3, 5), empty, *parts[1]), parts[1][0])


def test_a_sliding_window_is_refused_not_dropped():
    with pytest.raises(PackingUnsupported, match="sliding window"):
        _attention([3, 4], [(0, 5), (0, 5)], 5, cascade=True, window=64)


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)


def test_the_self_check_turns_cascade_on_and_it_gives_the_plain_numbers(llama, plain_models, monkeypatch):
    """Queries with their items (a /score with items) and items over prefilled states: within 1e-4 of a plain
    forward of each full sequence, through cascade attention, with no row mask built."""
    check = {c.name: c for c in llama.plan.checks}["cascade_attention"]
    assert check.enabled and check.difference < 1e-4 and llama.plan.prefix_attention == "cascade"
    assert llama.plan.as_dict()["prefix_attention"] == "cascade"
    calls = []
    real = models.cascade.cascade_attention
    monkeypatch.setattr(models.cascade, "cascade_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(_Segments, "mask", lambda *a: pytest.fail("a cascade call built the row's mask"))
    generator = torch.Generator().manual_seed(5)
    queries = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (11, 6)]
    items = [(0, [7, 8, 9]), (1, [12]), (0, [40, 41, 42, 43, 44]), (1, []), (1, [5, 6])]
    rows = [(p, suffix, len(suffix) + 1) for p, suffix in items]
    states, hidden = prefill_with_suffixes(llama.model, llama.plan, queries, rows, llama.pad_token_id)
    over = forward_suffixes(llama.model, llama.plan, [SuffixRow(states[p], tuple(s), k) for p, s, k in rows],
                            llama.pad_token_id)
    plain = plain_models["llama"]
    expected = torch.cat([position_logits(plain, queries[p] + suffix)[-keep:] for p, suffix, keep in rows])
    for got in (hidden, over):
        torch.testing.assert_close(head_logits(llama.plan, got), expected, atol=1e-4, rtol=0)
    assert calls


def test_a_wrong_merge_is_caught_and_switched_off(tiny_model_dirs, monkeypatch, caplog):
    """A merge that drops the prefix's part: the self-check sees it, switches cascade off with a WARNING, and the
    masked path serves."""
    monkeypatch.setattr(models.cascade, "merge_by_lse", lambda own, own_lse, spanned, spanned_lse: own)
    with caplog.at_level(logging.WARNING, logger="genscore.models"):
        loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)
    check = {c.name: c for c in loaded.plan.checks}["cascade_attention"]
    assert not check.enabled and check.difference > 1e-2 and "differs" in check.reason
    assert loaded.plan.prefix_attention == "masked" and loaded.plan.packed_suffixes
    assert any("cascade_attention: OFF" in r.getMessage() for r in caplog.records)


def test_a_call_cascade_cannot_honour_switches_it_off(tiny_model_dirs, monkeypatch):
    """A layer the cascade refuses (a sliding window, here said of every layer) raises at the probe: off, with why."""
    monkeypatch.setattr(models.cascade, "refusal", lambda window, dropout: "a sliding window of 4")
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)
    check = {c.name: c for c in loaded.plan.checks}["cascade_attention"]
    assert not check.enabled and "PackingUnsupported" in check.reason and "sliding window" in check.reason
    assert loaded.plan.prefix_attention == "masked" and loaded.plan.packed_suffixes


def test_a_soft_capped_model_keeps_the_masked_path(tmp_path):
    """Gemma-2 soft-caps its attention: packing refuses it, so suffixes do not run packed and no cascade is tried."""
    loaded = load_model(str(make_tiny_model(tmp_path / "gemma2", "gemma2")), device="cpu", dtype="float32",
                        cache_dir=None)
    check = {c.name: c for c in loaded.plan.checks}["cascade_attention"]
    assert not check.enabled and check.reason == models.cascade.NEEDS_PACKED_SUFFIXES
    assert loaded.plan.prefix_attention == "masked"
