"""Hints posted to a runner (for engines that cannot forward request data to storage).

The router posts each request's `kv_hint` envelope to the target runner; the runner keeps it,
keyed by block hash (the engine's event hash as u64), for a TTL and up to a cap. When a prefetch
later asks for those blocks, the book names the source. Pure: time comes in as `now`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .hints import FetchHint
from .keys import U64_MASK


@dataclass(frozen=True, slots=True)
class HintedSource:
    endpoint: str
    mode: str
    num_pages: int  # leading pages of the request the source is said to hold


@dataclass
class HintBook:
    ttl_s: float = 30.0
    max_hashes: int = 1_000_000
    num_posted: int = 0
    num_expired: int = 0
    num_evicted: int = 0

    def __post_init__(self) -> None:
        # block hash -> (source endpoint, mode, expiry), oldest first
        self._by_hash: OrderedDict[int, tuple[str, str, float]] = OrderedDict()

    def post(self, hint: FetchHint, now: float) -> None:
        expiry = now + self.ttl_s
        for h in hint.block_hashes:
            self._by_hash[h] = (hint.source_control_endpoint, hint.mode, expiry)
            self._by_hash.move_to_end(h)
        self.num_posted += 1
        while len(self._by_hash) > self.max_hashes:
            self._by_hash.popitem(last=False)
            self.num_evicted += 1

    def source_for(self, event_hashes: list[int], now: float) -> HintedSource | None:
        """The source hinted for the leading run of `event_hashes` (int64 or u64), if any."""
        first = None
        n = 0
        for h in event_hashes:
            entry = self._by_hash.get(h & U64_MASK)
            if entry is None or entry[2] <= now or (first is not None and entry[0] != first[0]):
                break
            first = first or entry
            n += 1
        return HintedSource(first[0], first[1], n) if first is not None else None

    def expire(self, now: float) -> int:
        gone = [h for h, (_, _, expiry) in self._by_hash.items() if expiry <= now]
        for h in gone:
            del self._by_hash[h]
        self.num_expired += len(gone)
        return len(gone)

    def __len__(self) -> int:
        return len(self._by_hash)
