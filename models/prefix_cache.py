"""The prefix cache: recent shared prefixes' key/value states, bounded in bytes, least recently used out first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from models.prefix import PrefixState


@dataclass
class PrefixCacheStats:
    """Counters of the prefix cache since start-up."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0


class PrefixCache:
    """LRU map from prefix tokens to their PrefixState, bounded by the bytes the states hold.

    Used from the single forward thread only. capacity 0 turns it off (every lookup misses,
    nothing is stored). A state larger than the whole capacity is never stored.
    """

    def __init__(self, capacity_bytes: int):
        self._entries: OrderedDict[tuple[int, ...], PrefixState] = OrderedDict()
        self.stats = PrefixCacheStats(capacity_bytes=capacity_bytes)

    def get(self, tokens: tuple[int, ...]) -> PrefixState | None:
        state = self._entries.get(tokens)
        if state is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(tokens)
        self.stats.hits += 1
        return state

    def put(self, state: PrefixState) -> None:
        size = state.nbytes
        if size > self.stats.capacity_bytes or state.tokens in self._entries:
            return
        while self._entries and self.stats.bytes + size > self.stats.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.stats.bytes -= old.nbytes
            self.stats.evictions += 1
        self._entries[state.tokens] = state
        self.stats.bytes += size
        self.stats.entries = len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.stats.bytes = 0
        self.stats.entries = 0
