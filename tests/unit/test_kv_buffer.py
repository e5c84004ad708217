"""models/kv_buffer.py: the decode cache written in place gives the numbers of transformers' DynamicCache, through
prefill, decode steps and the batch surgery (rows joining, leaving, repeated), and a step writes into the same buffer
instead of reallocating the cache; a buffer that writes wrong is caught by the self-check."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import models.kv_buffer
from models import load_model
from models.decoding import decode_step, drop_partial_step, merge, prefill, select_rows
from models.head import head_logits
from models.kv_buffer import BufferCache

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40, 41, 42]]


def test_a_layer_update_matches_concatenation_and_writes_in_place():
    torch.manual_seed(0)
    cache, reference = BufferCache(capacity=12), DynamicCache()
    pointers = set()
    for width in (5, 1, 1, 1, 1):
        keys, values = torch.randn(2, 3, width, 4), torch.randn(2, 3, width, 4)
        got = cache.update(keys, values, 0)
        want = reference.update(keys, values, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        pointers.add(cache.layers[0].key_buffer.data_ptr())
    assert len(pointers) == 1, "a step within capacity reallocated the buffer"
    assert cache.get_seq_length() == 9 and cache.layers[0].key_buffer.shape[-2] == 12


def test_a_full_buffer_grows_and_keeps_its_columns():
    torch.manual_seed(0)
    cache, reference = BufferCache(), DynamicCache()
    for width in (3, *([1] * 40)):
        keys, values = torch.randn(1, 2, width, 4), torch.randn(1, 2, width, 4)
        got, want = cache.update(keys, values, 0), reference.update(keys, values, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert cache.layers[0].key_buffer.shape[-2] >= 43


def _alone_greedy(plain, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """The reference: one sequence through the plain model with transformers' DynamicCache, greedy."""
    with torch.inference_mode():
        cache = DynamicCache()
        out = plain(torch.tensor([prompt]), cache=cache, use_cache=True)
        logits, tokens = [out.logits[0, -1].float()], []
        for _ in range(steps):
            tokens.append(int(logits[-1].argmax()))
            out = plain(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1].float())
    return tokens, torch.stack(logits)  # [steps + 1, V]


def test_rows_joining_and_leaving_decode_as_each_row_alone_with_a_dynamic_cache(tiny_loaded, plain_tiny):
    """Two prompts decode, two more join (one of them as two choices), one leaves, the rest go on: every row's
    greedy tokens are those of its prompt alone through transformers' DynamicCache, its logits within 1e-5."""
    model, plan, pad = tiny_loaded.model, tiny_loaded.plan, tiny_loaded.pad_token_id
    assert plan.decoding == "batched"
    steps = 8
    expected = [_alone_greedy(plain_tiny, p, 2 * steps) for p in PROMPTS]  # rows decoding from the start run longer
    got_tokens: dict[int, list[int]] = {}  # per row id (its prompt; 4 is the second choice of prompt 2)
    got_logits: dict[int, list[torch.Tensor]] = {}

    def start(prompts: list[int]):
        hidden, batch = prefill(model, plan, [PROMPTS[p] for p in prompts], pad)
        return head_logits(plan, hidden[:, -1, :]), batch

    def take(ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for row, values in zip(ids, logits):
            got_logits.setdefault(row, []).append(values)
            got_tokens.setdefault(row, []).append(int(values.argmax()))
        return torch.tensor([got_tokens[row][-1] for row in ids])

    with torch.inference_mode():
        logits, batch = start([0, 1])
        ids = [0, 1]
        batch = select_rows(batch, [0, 1], [len(PROMPTS[0]) + steps, len(PROMPTS[1]) + steps])
        tokens = take(ids, logits)
        for _ in range(3):
            tokens = take(ids, decode_step(model, plan, batch, tokens))
        joined_logits, joined = start([2, 3])
        # prompt 2 decodes as two choices (rows 2 and 4), prompt 3 once
        joined = select_rows(joined, [0, 0, 1], [len(PROMPTS[2]) + steps] * 2 + [len(PROMPTS[3]) + steps])
        new_tokens = take([2, 4, 3], joined_logits[[0, 0, 1]])
        batch, ids = merge(batch, joined), ids + [2, 4, 3]
        tokens = torch.cat([tokens, new_tokens])
        tokens = take(ids, decode_step(model, plan, batch, tokens))
        batch, ids, tokens = select_rows(batch, [1, 2, 3, 4]), ids[1:], tokens[1:]  # prompt 0 leaves
        while min(len(got_tokens[row]) for row in ids) < steps + 1:
            tokens = take(ids, decode_step(model, plan, batch, tokens))
    for row, values in got_logits.items():
        prompt = 2 if row == 4 else row
        want_tokens, want_logits = expected[prompt]
        n = len(values)
        assert got_tokens[row][:n - 1] == want_tokens[:n - 1]
        difference = (torch.stack(values) - want_logits[:n]).abs().max().item()
        assert difference < 1e-5, (row, difference)


def test_buffers_are_sized_for_the_final_width_and_steps_do_not_reallocate(tiny_loaded):
    model, plan, pad = tiny_loaded.model, tiny_loaded.plan, tiny_loaded.pad_token_id
    with torch.inference_mode():
        _, batch = prefill(model, plan, PROMPTS[:2], pad)
        batch = select_rows(batch, [0, 1], [len(PROMPTS[0]) + 6, len(PROMPTS[1]) + 6])
        layers = batch.cache.layers
        assert all(layer.key_buffer.shape[-2] == len(PROMPTS[0]) + 6 for layer in layers)
        pointers = [layer.key_buffer.data_ptr() for layer in layers]
        for _ in range(5):
            decode_step(model, plan, batch, torch.tensor([5, 6]))
        assert [layer.key_buffer.data_ptr() for layer in batch.cache.layers] == pointers
        assert batch.width == len(PROMPTS[0]) + 5
        # a failed step's column is cut: the next step writes where it would have
        drop_partial_step(batch, batch.width - 1)
        assert all(layer.keys.shape[-2] == batch.width - 1 for layer in batch.cache.layers)


def test_a_buffer_that_writes_the_wrong_column_is_switched_off_by_the_self_check(tiny_model_dirs, monkeypatch):
    real = models.kv_buffer.BufferLayer.update

    def wrong_column(self, key_states, value_states, *args, **kwargs):  # a step's key also lands a column early
        start = self.get_seq_length()
        out = real(self, key_states, value_states, *args, **kwargs)
        if key_states.shape[-2] == 1 and start > 0:
            self.key_buffer[:, :, start - 1].copy_(key_states[:, :, 0])
        return out

    monkeypatch.setattr(models.kv_buffer.BufferLayer, "update", wrong_column)
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)
    checks = {check.name: check for check in loaded.plan.checks}
    assert not checks["batched_decoding"].enabled and checks["batched_decoding"].difference > 1e-3
    assert loaded.plan.decoding == "per_request"


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_other_architectures_decode_batched_as_alone(tiny_model_dirs, plain_models, arch):
    loaded = load_model(str(tiny_model_dirs[arch]), device="cpu", dtype="float32", cache_dir=None)
    model, plan, pad = loaded.model, loaded.plan, loaded.pad_token_id
    if plan.decoding != "batched":
        pytest.skip(f"{arch} does not decode batched")
    steps = 5
    expected = [_alone_greedy(plain_models[arch], p, steps) for p in PROMPTS[:3]]
    with torch.inference_mode():
        hidden, batch = prefill(model, plan, PROMPTS[:3], pad)
        batch = select_rows(batch, [0, 1, 2], [len(p) + steps for p in PROMPTS[:3]])
        logits = [head_logits(plan, hidden[:, -1, :])]
        for _ in range(steps):
            logits.append(decode_step(model, plan, batch, logits[-1].argmax(-1)))
    got = torch.stack(logits, dim=1)  # [3, steps + 1, V]
    for row, (tokens, want) in enumerate(expected):
        assert got[row, :-1].argmax(-1).tolist() == tokens
        assert (got[row] - want).abs().max().item() < 1e-5
