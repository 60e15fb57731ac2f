"""Claims `batch_exists` took at peers, waiting for `batch_get` (thread-safe; no I/O).

A claim covers a run of keys. Two requests may share a first key and then diverge, so claims are
found by their whole run: a read only ever collects the claim whose keys are exactly the keys it
reads, never another request's pages. Requests that count on the same claim all own it: one of
them ending gives it back only when no other owner is left. A claim granted after every request
that asked for it ended (the source answered late) is refused on arrival, so it goes back at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcr.drivers.puller import Confirmation


@dataclass
class Pending:
    conf: Confirmation
    page_hexes: list[str]
    owners: set[str | None] = field(default_factory=lambda: {None})  # request ids (None: unknown)


MAX_ENDED = 10_000  # request ids whose prefetch ended, remembered for claims granted after it


class PendingClaims:
    def __init__(self) -> None:
        self._by_first: dict[str, list[Pending]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, pending: Pending) -> bool:
        """Hold the claim; False (not held: give it back now) when every request that counts on it
        has already ended its prefetch."""
        with self._lock:
            if None not in pending.owners and all(o in self._ended for o in pending.owners):
                return False
            self._by_first.setdefault(pending.page_hexes[0], []).append(pending)
            return True

    def _match(self, keys: list[str], pos: int) -> Pending | None:
        for p in self._by_first.get(keys[pos], ()):
            n = min(len(p.page_hexes), len(keys) - pos)
            if p.page_hexes[:n] == keys[pos:pos + n]:
                return p
        return None

    def covered(self, keys: list[str], start: int, owner: str | None = None) -> int:
        """How far from `start` whole claimed runs of exactly these keys reach; `owner` (the asking
        request) joins the owners of every claim it now counts on."""
        with self._lock:
            while start < len(keys) and (p := self._match(keys, start)) is not None \
                    and len(p.page_hexes) <= len(keys) - start:
                p.owners.add(owner)
                start += len(p.page_hexes)
        return start

    def started(self, owner: str | None) -> None:
        """`owner` starts a prefetch (SGLang retries and re-prefetches under the same request id):
        its grants count again."""
        with self._lock:
            self._ended.pop(owner, None)

    def first_claimed(self, keys: list[str]) -> int:
        """Where the first claim on exactly these keys starts (len(keys): none): the pages before
        it are expected locally, the rest from peers."""
        with self._lock:
            return next((i for i in range(len(keys)) if self._match(keys, i) is not None), len(keys))

    def take(self, keys: list[str], pos: int) -> Pending | None:
        """Remove and return the claim whose run starts with keys[pos:] (or is their prefix)."""
        with self._lock:
            p = self._match(keys, pos)
            if p is not None:
                self._remove(p)
            return p

    def _remove(self, p: Pending) -> None:
        runs = self._by_first[p.page_hexes[0]]
        runs.remove(p)
        if not runs:
            del self._by_first[p.page_hexes[0]]

    def take_starting_in(self, keys: list[str], owner: str | None) -> list[Pending]:
        """`owner`'s prefetch over `keys` ended: it leaves every claim starting at one of them;
        returns the claims no request owns any more."""
        wanted = set(keys)
        with self._lock:
            if owner is not None:
                self._ended[owner] = None
                while len(self._ended) > MAX_ENDED:
                    self._ended.popitem(last=False)
            mine = [p for first, runs in self._by_first.items() if first in wanted for p in runs if owner in p.owners]
            gone = []
            for p in mine:
                p.owners.discard(owner)
                if not p.owners:
                    self._remove(p)
                    gone.append(p)
        return gone

    def expire(self, now: float) -> list[Pending]:
        """Claims whose lease may be over (the pull owns the lease): SGLang never collected them."""
        with self._lock:
            gone = [p for runs in self._by_first.values() for p in runs if p.conf.lease_over(now)]
            for p in gone:
                self._remove(p)
        return gone

    def drain(self) -> list[Pending]:
        with self._lock:
            gone = [p for runs in self._by_first.values() for p in runs]
            self._by_first.clear()
        return gone

    def __len__(self) -> int:
        with self._lock:
            return sum(len(runs) for runs in self._by_first.values())
