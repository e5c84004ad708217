"""The CPU decode kernel (models/attention_cpu.py decode_attention_cpu): each row's one query against its own keys in
the left-padded decode cache, the numbers of SDPA under the cache's mask; generation through it gives the plain
forward's; what it does not serve runs SDPA; and the self-check that switches it off when it disagrees."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import models.attention_cpu as attention_cpu
import models.packed as packed
from models.decoding import decode_step, prefill
from models.selfcheck import DECODE_KERNEL_PATH, install_fast_paths
from tests.unit.packed_attention_cases import attention_model, require_cpu_kernels

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kernel():
    require_cpu_kernels()
    return torch.ops.genscore_cpu.decode_attention


def _padded_case(dtype, head_dim, kv_heads, lengths, capacity=50, seed=0, heads=4):
    """query [B, H, 1, D]; key, value [B, H_kv, W, D] as views of buffers with room for `capacity` columns, each row's
    real keys its last `lengths[b]` columns and random numbers (not zeros) in its padding."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    query = (torch.randn(rows, heads, 1, head_dim, generator=generator) * 2).to(dtype)
    keys = (torch.randn(rows, kv_heads, capacity, head_dim, generator=generator) * 2).to(dtype)[:, :, :width]
    values = torch.randn(rows, kv_heads, capacity, head_dim, generator=generator).to(dtype)[:, :, :width]
    return query, keys, values, torch.tensor(lengths)


def _reference(query, keys, values, lengths, scale=None):
    """SDPA in float64, each row over its own last columns: [B, 1, H, D]."""
    width = keys.shape[2]
    sees = torch.arange(width)[None] >= width - lengths[:, None]  # [B, W]
    out = F.scaled_dot_product_attention(query.double(), keys.double(), values.double(), attn_mask=sees[:, None, None],
                                         scale=scale, enable_gqa=True)  # [B, H, 1, D]
    return out.transpose(1, 2)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1), (9, 3), (6, 1)],
                         ids=["mha", "gqa", "mqa", "groups-of-3", "a-group-of-6"])
def test_each_row_attends_to_its_own_keys_in_float32(kernel, head_dim, heads, kv_heads):
    """Groups of every size: the kernel takes a key/value head's query heads a few at a time."""
    case = _padded_case(torch.float32, head_dim, kv_heads, [1, 7, 33, 40, 16, 39], heads=heads)
    got = attention_cpu.decode_attention_cpu(*case, None)
    assert got.shape == (6, 1, heads, head_dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(*case), atol=1e-5, rtol=0)


def test_bfloat16_within_its_rounding_and_a_scale(kernel):
    query, keys, values, lengths = _padded_case(torch.bfloat16, 64, 2, [3, 25, 12])
    got = attention_cpu.decode_attention_cpu(query, keys, values, lengths, 0.2)
    expected = _reference(query.float(), keys.float(), values.float(), lengths, 0.2)
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=0)


def test_bfloat16_results_are_the_float32_ones_rounded_to_nearest_even(kernel):
    """As varlen_attention: float32 sums of the bfloat16 values, each result rounded as torch rounds to bfloat16."""
    query, keys, values, lengths = _padded_case(torch.bfloat16, 64, 2, [3, 25, 12], heads=6)
    got = attention_cpu.decode_attention_cpu(query, keys, values, lengths, 0.2)
    in_float32 = attention_cpu.decode_attention_cpu(query.float(), keys.float(), values.float(), lengths, 0.2)
    assert torch.equal(got.view(torch.int16), in_float32.bfloat16().view(torch.int16))


def test_a_row_gives_the_same_bits_whatever_its_neighbours(kernel):
    """A row reads its own columns only, not its neighbours' nor the padding they leave it."""
    query, keys, values, lengths = _padded_case(torch.float32, 16, 2, [9, 30, 17])
    batched = attention_cpu.decode_attention_cpu(query, keys, values, lengths, None)
    alone = attention_cpu.decode_attention_cpu(query[:1], keys[:1, :, -9:], values[:1, :, -9:], lengths[:1], None)
    assert torch.equal(alone, batched[:1])


def test_what_the_kernel_does_not_serve_is_none(kernel):
    query, keys, values, lengths = _padded_case(torch.float32, 16, 2, [4, 6])
    assert attention_cpu.decode_attention_cpu(query.half(), keys.half(), values.half(), lengths, None) is None
    two_queries = torch.cat([query, query], dim=2)  # [B, H, 2, D]: not a decode step
    assert attention_cpu.decode_attention_cpu(two_queries, keys, values, lengths, None) is None
    with pytest.raises(RuntimeError, match="length"):
        attention_cpu.decode_attention_cpu(query, keys, values, torch.tensor([4, 7]), None)  # more than the columns


def _decoded_logits(model, plan, sequences, steps=4):
    """Each sequence prefilled without its last `steps` tokens, then fed them one decode step at a time, rows of
    different lengths batched: the logits after every step, [B, steps, V]."""
    with torch.inference_mode():
        hidden, batch = prefill(model, plan, [seq[:-steps] for seq in sequences], 0)
        got = []
        for step in range(steps):
            tokens = torch.tensor([seq[len(seq) - steps + step] for seq in sequences])
            got.append(decode_step(model, plan, batch, tokens))
        return torch.stack(got, dim=1)


def _plain_logits(model, sequences, steps=4):
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([seq])).logits[0, -steps:] for seq in sequences])


def _verdict(plan):
    return next(check for check in plan.checks if check.name == DECODE_KERNEL_PATH)


SEQUENCES = [[int(x) for x in torch.randint(1, 299, (n,), generator=torch.Generator().manual_seed(n))]
             for n in (6, 31, 12, 45)]


def test_the_self_check_turns_it_on_and_decoding_gives_the_plain_forward(kernel, monkeypatch):
    model = attention_model(None, layers=3)
    plan = install_fast_paths(model, 300, 64, 0)
    assert plan.decode_kernel and _verdict(plan).enabled and _verdict(plan).difference < 1e-4
    served = []  # per layer and step: whether the kernel served the call

    def spy(*args):
        out = attention_cpu.decode_attention_cpu(*args)
        served.append(out is not None)
        return out

    monkeypatch.setattr(packed, "decode_attention_cpu", spy)
    got = _decoded_logits(model, plan, SEQUENCES)
    torch.testing.assert_close(got, _plain_logits(model, SEQUENCES), atol=1e-4, rtol=0)
    assert served == [True] * 3 * 4
    sdpa = _decoded_logits(model, replace(plan, decode_kernel=False), SEQUENCES)
    torch.testing.assert_close(got, sdpa, atol=1e-5, rtol=0)


def test_a_sliding_window_layer_keeps_sdpa(kernel, monkeypatch):
    """The kernel reads no mask, so a layer with a window never reaches it: SDPA applies the window."""
    model = attention_model(8)
    plan = install_fast_paths(model, 300, 64, 0)
    if plan.decoding != "batched":
        pytest.skip("this model does not decode batched")
    served = []
    monkeypatch.setattr(packed, "decode_attention_cpu", lambda *args: served.append(args) or None)
    got = _decoded_logits(model, replace(plan, decode_kernel=True), SEQUENCES)
    torch.testing.assert_close(got, _plain_logits(model, SEQUENCES), atol=1e-4, rtol=0)
    assert served == []


def test_a_kernel_that_disagrees_is_switched_off(kernel, monkeypatch):
    """Break the kernel on purpose (each row forgets its oldest key): the self-check measures it and keeps SDPA."""
    real = attention_cpu.decode_attention_cpu

    def forgets_a_key(query, key, value, lengths, scaling):
        return real(query, key, value, (lengths - 1).clamp(min=1), scaling)

    monkeypatch.setattr(packed, "decode_attention_cpu", forgets_a_key)
    model = attention_model(None)
    plan = install_fast_paths(model, 300, 64, 0)
    assert not plan.decode_kernel and not _verdict(plan).enabled and _verdict(plan).difference > 1e-3
    assert plan.decoding == "batched"
    torch.testing.assert_close(_decoded_logits(model, plan, SEQUENCES), _plain_logits(model, SEQUENCES), atol=1e-4,
                               rtol=0)


def test_a_machine_that_cannot_build_it_keeps_sdpa(monkeypatch):
    monkeypatch.setattr(attention_cpu, "_built", {"error": "the CPU attention kernel could not be built: no g++"})
    plan = install_fast_paths(attention_model(None), 300, 64, 0)
    assert not plan.decode_kernel and not _verdict(plan).enabled and "no g++" in _verdict(plan).reason
    assert plan.decoding == "batched"
