"""sample(): next-token ids from processed logits, greedy or drawn with each row's own generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batch import check_batch
from .params import SamplingParams
from .processors import process


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """[B, V] logits -> [B] int64 token ids.

    Greedy rows (temperature None or 0) take the argmax of their processed logits
    (the first max on ties). Other rows draw from softmax(processed logits) with
    their own generator (None = the global RNG), so a seeded row gets the same
    token whatever its batch neighbours are.
    """
    check_batch(logits, params)
    if len(generators) != len(params):
        raise ValueError(f"got {len(generators)} generators for {len(params)} rows")
    x = process(logits, params)  # [B, V] float32
    tokens = x.argmax(dim=-1)  # [B], final for greedy rows

    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not random_rows:
        return tokens
    idx = torch.tensor(random_rows, dtype=torch.long, device=x.device)
    probs = torch.softmax(x[idx], dim=-1)  # [n, V]; filtered tokens have probability exactly 0

    # exponential race (vLLM): argmax(p / q) with q ~ Exp(1) picks token i with probability p_i.
    # Each seeded row draws its own q from its own generator, so its draw depends only on
    # (generator state, its own probs); unseeded rows share one draw from the global RNG.
    q = torch.empty_like(probs)  # [n, V]
    unseeded = [j for j, i in enumerate(random_rows) if generators[i] is None]
    if unseeded:
        q[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=x.device).exponential_()
    for j, i in enumerate(random_rows):
        gen = generators[i]
        if gen is not None:
            q[j].exponential_(generator=gen)
    race = probs / q  # [n, V]
    # a zero-probability token must never win, not even through 0/0 = NaN if q underflowed to 0
    race = torch.where(probs > 0, race, -1.0)
    tokens[idx] = race.argmax(dim=-1)
    return tokens
