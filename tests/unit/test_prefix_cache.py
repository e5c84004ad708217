"""The prefix cache's LRU order, byte bound and counters, and the common-prefix helper (no model needed)."""

from __future__ import annotations

import torch

from app.engine.scoring import common_prefix_len
from models.prefix import PrefixState
from models.prefix_cache import PrefixCache


def state(tokens: tuple[int, ...], layers: int = 2) -> PrefixState:
    kv = tuple(torch.zeros(1, 2, len(tokens), 4) for _ in range(layers))  # [1, H, P, D] float32
    return PrefixState(tokens, kv, kv, torch.zeros(8))


def test_nbytes_counts_keys_values_and_last_hidden():
    s = state((1, 2, 3))
    assert s.nbytes == 2 * 2 * (2 * 3 * 4 * 4) + 8 * 4


def test_hits_misses_and_lru_eviction_by_bytes():
    one = state((1,))
    cache = PrefixCache(capacity_bytes=3 * one.nbytes)
    a, b, c, d = state((1,)), state((2,)), state((3,)), state((4,))
    assert cache.get((1,)) is None
    for s in (a, b, c):
        cache.put(s)
    assert cache.get((1,)) is a  # a becomes most recent; b is now the oldest
    cache.put(d)
    assert cache.get((2,)) is None and cache.get((3,)) is c and cache.get((4,)) is d and cache.get((1,)) is a
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.evictions, stats.entries) == (4, 2, 1, 3)
    assert stats.bytes == 3 * one.nbytes <= stats.capacity_bytes


def test_a_state_larger_than_the_cache_is_not_stored_and_zero_capacity_is_off():
    big = state(tuple(range(50)))
    cache = PrefixCache(capacity_bytes=big.nbytes - 1)
    cache.put(big)
    assert cache.get(big.tokens) is None and cache.stats.entries == 0
    off = PrefixCache(capacity_bytes=0)
    off.put(state((1,)))
    assert off.get((1,)) is None and off.stats.bytes == 0


def test_clear_empties_but_keeps_counters():
    cache = PrefixCache(capacity_bytes=10**6)
    cache.put(state((1, 2)))
    assert cache.get((1, 2)) is not None
    cache.clear()
    assert cache.get((1, 2)) is None and cache.stats.entries == 0 and cache.stats.bytes == 0
    assert cache.stats.hits == 1 and cache.stats.misses == 1


def test_common_prefix_len():
    assert common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_len([[1, 2, 3]]) == 3
    assert common_prefix_len([[5], [6]]) == 0
    assert common_prefix_len([[1, 2], [1, 2]]) == 2
