"""A scoring forward waits for the device a constant number of times: the ops that would sync a GPU (a value read
back, a data-dependent shape) and the ops per layer, counted on CPU, do not grow with prompts or layers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import sampler
from models.forward import forward_logits
from models.op_count import OpCounter
from models.packed import use_packed_attention
from models.prefix import prefill_with_suffixes
from models.selfcheck import plain_plan
from sampler import SamplingParams

pytestmark = pytest.mark.unit

# The most syncs one packed forward may make: none (a packed row has no padding, so its masks are built without
# asking the device whether the padding mask is all ones; a CUDA graph capture would refuse that question).
MAX_FORWARD_SYNCS = 0


def _model(layers: int, window: int | None):
    body = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=300, num_hidden_layers=layers, max_position_embeddings=256)
    config = transformers.MistralConfig(**body, sliding_window=window) if window else transformers.LlamaConfig(**body)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert use_packed_attention(model)
    # packed calls, and suffixes over key/value prefixes packed too: what the self-check keeps for such a model
    return model, replace(plain_plan(model), layout="packed", prefix_reuse="key_values", packed_suffixes=True)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(n)
    return [[rng.randrange(1, 299) for _ in range(rng.randint(20, 40))] for _ in range(n)]


def _count(run):
    run()  # first call: lazy initialisation is not what is counted
    with OpCounter() as counter:
        run()
    return counter.counts


def _forward(model_and_plan, prompts):
    model, plan = model_and_plan
    return _count(lambda: forward_logits(model, plan, prompts, 0))


def _shared_prefix(model_and_plan, prompts):
    model, plan = model_and_plan
    prefix = prompts[0][:16]
    return _count(lambda: prefill_with_suffixes(model, plan, [prefix], [(0, p[:10], 1) for p in prompts], 0))


@pytest.mark.parametrize("window", [None, 8], ids=["plain", "sliding"])
def test_packed_forward_syncs_and_ops_per_layer_do_not_grow(window):
    counts = {(layers, n): _forward(_model(layers, window), _prompts(n)) for layers in (4, 30) for n in (8, 32)}
    for (layers, n), c in counts.items():
        assert c.syncs <= MAX_FORWARD_SYNCS, (layers, n, dict(c.sync_names))
    # ops per forward: the same for 8 and 32 prompts (one attention op per layer), and linear in the layers
    assert counts[(30, 8)].kernels == counts[(30, 32)].kernels
    assert counts[(4, 8)].kernels == counts[(4, 32)].kernels
    assert counts[(30, 32)].syncs == counts[(4, 32)].syncs
    per_layer = (counts[(30, 32)].kernels - counts[(4, 32)].kernels) / 26
    assert per_layer <= 40, dict(counts[(30, 32)].kernel_names)


def test_shared_prefix_forward_makes_no_sync():
    model_and_plan = _model(30, None)
    for n in (8, 32):
        c = _shared_prefix(model_and_plan, _prompts(n))
        assert c.syncs == 0, dict(c.sync_names)


def test_sampler_syncs_do_not_grow_with_the_batch():
    torch.manual_seed(0)
    counts = []
    for batch in (4, 32):
        logits = torch.randn(batch, 1000) * 5
        params = [SamplingParams(label_token_ids=(1, 2, 3), top_logprobs=20)] * batch
        counts.append(_count(lambda logits=logits, params=params: sampler.score(logits, params)).syncs)
    assert counts[0] == counts[1] <= 2
