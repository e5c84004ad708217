"""A ranking from pairwise win probabilities: the Bradley-Terry maximum-likelihood strengths (Hunter's MM iteration),
with each comparison counted as fractional wins."""

from __future__ import annotations

import math

_FLOOR = 1e-9  # a certain win (p = 1) has no finite maximum-likelihood strength; keep every win fractional


def bradley_terry(n: int, wins: dict[tuple[int, int], float], iterations: int = 10_000, tolerance: float = 1e-12
                  ) -> list[float]:
    """wins[(i, j)] = p(i beats j) for i < j -> each item's log-strength, mean 0, so p(i beats j) is modelled as
    1 / (1 + exp(s_j - s_i))."""
    won = [0.0] * n
    opponents: list[list[int]] = [[] for _ in range(n)]
    for (i, j), p in wins.items():
        p = min(max(p, _FLOOR), 1 - _FLOOR)
        won[i] += p
        won[j] += 1 - p
        opponents[i].append(j)
        opponents[j].append(i)
    strength = [1.0] * n
    for _ in range(iterations):
        updated = [won[i] / math.fsum(1 / (strength[i] + strength[j]) for j in opponents[i]) if opponents[i] else 1.0
                   for i in range(n)]
        scale = math.exp(math.fsum(math.log(s) for s in updated) / n)  # geometric mean 1: the scale is free
        updated = [s / scale for s in updated]
        change = max(abs(math.log(a) - math.log(b)) for a, b in zip(updated, strength))
        strength = updated
        if change < tolerance:
            break
    return [math.log(s) for s in strength]
