"""sample(): next-token ids from processed logits, greedy or drawn with each row's own generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batch import check_batch
from .params import SamplingParams
from .processors import process

# Tokens per block of the two-level inverse CDF: a block's running sum is the only sequential part.
CDF_BLOCK = 256


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
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    every_row = len(random_rows) == len(params)
    # [B]: greedy rows' tokens are final; an argmax over a batch with no greedy row would be wasted
    tokens = torch.empty(len(params), dtype=torch.long, device=x.device) if every_row else x.argmax(dim=-1)
    if not random_rows:
        return tokens
    idx = torch.tensor(random_rows, dtype=torch.long, device=x.device)
    probs = torch.softmax(x if every_row else x[idx], dim=-1)  # [n, V]; filtered tokens have probability exactly 0
    # One uniform draw per row (an exponential race would draw V of them, most of a decode step's sampling time).
    # Each seeded row draws from its own generator, so its token depends only on (generator state, its own probs);
    # unseeded rows share one draw from the global RNG.
    u = torch.empty(len(random_rows), dtype=torch.float64, device=x.device)  # [n]
    unseeded = [j for j, i in enumerate(random_rows) if generators[i] is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=x.device)
    for j, i in enumerate(random_rows):
        if generators[i] is not None:
            u[j] = torch.rand((), dtype=torch.float64, generator=generators[i], device=x.device)
    tokens[idx] = inverse_cdf(probs, u)
    return tokens


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """[n, V] probabilities and [n] uniform draws in [0, 1) -> [n] token ids, token i with probability p_i.

    The first token whose cumulative probability exceeds u x total, summed in float64 so that a token of tiny
    probability keeps its share. In two levels, because a running sum over the whole vocabulary is sequential: the
    sums of blocks of tokens find the block, a running sum inside that one block finds the token. A zero-probability
    token never wins: its running sum equals the one before it, and where the two levels round differently the pick
    falls back to the block's last token of positive probability."""
    rows, vocab = probs.shape
    blocks = -(-vocab // block)
    padded = torch.nn.functional.pad(probs, (0, blocks * block - vocab)).view(rows, blocks, block)  # zeros never win
    block_ends = padded.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [n, blocks], mass up to each block's end
    threshold = u.unsqueeze(1) * block_ends[:, -1:]  # [n, 1]; u < 1 keeps it below the total
    chosen = torch.searchsorted(block_ends, threshold, right=True).clamp_(max=blocks - 1)  # [n, 1]
    before = torch.where(chosen > 0, block_ends.gather(1, (chosen - 1).clamp_(min=0)), 0.0)  # [n, 1]
    inside = padded.gather(1, chosen.unsqueeze(2).expand(rows, 1, block)).squeeze(1)  # [n, block]
    running = before + torch.cumsum(inside, dim=-1, dtype=torch.float64)  # [n, block]
    picked = torch.searchsorted(running, threshold, right=True)  # [n, 1]
    last_positive = torch.searchsorted(running, running[:, -1:].contiguous(), right=False)  # [n, 1]
    return (chosen * block + torch.minimum(picked, last_positive)).squeeze(1)  # [n]
