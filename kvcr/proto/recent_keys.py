"""RecentKeys: the keys a pool committed lately, in bounded memory (a hash each, oldest forgotten
first). Tells a peer's claim for a page we let go (an eviction race) from one for a page we never
held (a router's mistake)."""

from __future__ import annotations

from typing import Iterable

MAX_KEYS = 1 << 18  # ~25 MB of memory at most, whatever the pool's size


class RecentKeys:
    def __init__(self, capacity: int) -> None:
        self.capacity = min(capacity, MAX_KEYS)
        self._hashes: dict[int, None] = {}  # insertion order: oldest first

    def add(self, key: str) -> None:
        hashes = self._hashes
        hashes.pop(hash(key), None)
        hashes[hash(key)] = None
        if len(hashes) > self.capacity:
            del hashes[next(iter(hashes))]

    def update(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.add(key)

    def __contains__(self, key: str) -> bool:
        return hash(key) in self._hashes
