"""forward_logits on mixed lengths: micro-batching must not change rows, their order, or keep_last's layout."""

from __future__ import annotations

import random

import torch

from models.forward import forward_logits, plan_micro_batches


def _alone(loaded, seq, keep):
    with torch.inference_mode():
        return loaded.model(torch.tensor([seq])).logits[0, -keep:].float()  # [keep, V]


def test_mixed_lengths_match_each_sequence_alone_in_caller_order(tiny_loaded):
    rng = random.Random(3)
    vocab = tiny_loaded.vocab_size
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 60, 5, 61, 4, 90, 2, 58)]
    assert len(plan_micro_batches([len(s) for s in sequences])) > 1  # the case under test: several calls
    keep = [1, 2, 1, 3, 2, 1, 1, 2]
    got = forward_logits(tiny_loaded.model, sequences, tiny_loaded.pad_token_id, keep_last=keep)  # [sum(keep), V]
    expected = torch.cat([_alone(tiny_loaded, s, k) for s, k in zip(sequences, keep)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    last_only = forward_logits(tiny_loaded.model, sequences, tiny_loaded.pad_token_id)  # [B, V]
    torch.testing.assert_close(last_only, torch.stack([_alone(tiny_loaded, s, 1)[0] for s in sequences]),
                               atol=1e-5, rtol=0)
