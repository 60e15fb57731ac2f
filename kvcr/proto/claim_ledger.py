"""The claims a destination holds at peers between a lookup and the read that collects them (the
bookkeeping alone: no I/O, no lock, `now` passed in; kvcr/drivers/claim_holder.py drives it).

A claim covers a run of keys. Two requests may share a first key and then diverge, so claims are
found by their whole run: a read only ever collects the claim whose keys are exactly the keys it
reads, never another request's pages. Requests that count on the same claim all own it: one of
them ending gives it back only when no other owner is left. A claim granted after every request
that asked for it ended (the source answered late) is refused on arrival, so it goes back at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol


class Leased(Protocol):
    """A confirmed claim as the ledger sees it: the pull behind it decides when its lease is over."""

    def lease_over(self, now: float) -> bool: ...


@dataclass
class HeldClaim:
    conf: Leased
    page_hexes: list[str]
    owners: set[str | None] = field(default_factory=lambda: {None})  # request ids (None: unknown)


MAX_ENDED = 10_000  # request ids whose prefetch ended, remembered for claims granted after it


class ClaimLedger:
    def __init__(self) -> None:
        self._by_first: dict[str, list[HeldClaim]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()

    def add(self, claim: HeldClaim) -> bool:
        """Hold the claim; False (not held: give it back now) when every request that counts on it
        has already ended its prefetch."""
        if None not in claim.owners and all(o in self._ended for o in claim.owners):
            return False
        self._by_first.setdefault(claim.page_hexes[0], []).append(claim)
        return True

    def _match(self, keys: list[str], pos: int) -> HeldClaim | None:
        for p in self._by_first.get(keys[pos], ()):
            n = min(len(p.page_hexes), len(keys) - pos)
            if p.page_hexes[:n] == keys[pos:pos + n]:
                return p
        return None

    def covered(self, keys: list[str], start: int, owner: str | None = None) -> int:
        """How far from `start` whole claimed runs of exactly these keys reach; `owner` (the asking
        request) joins the owners of every claim it now counts on."""
        while start < len(keys) and (p := self._match(keys, start)) is not None \
                and len(p.page_hexes) <= len(keys) - start:
            p.owners.add(owner)
            start += len(p.page_hexes)
        return start

    def started(self, owner: str | None) -> None:
        """`owner` starts a prefetch (SGLang retries and re-prefetches under the same request id):
        its grants count again."""
        self._ended.pop(owner, None)

    def first_claimed(self, keys: list[str]) -> int:
        """Where the first claim on exactly these keys starts (len(keys): none): the pages before
        it are expected locally, the rest from peers."""
        return next((i for i in range(len(keys)) if self._match(keys, i) is not None), len(keys))

    def take(self, keys: list[str], pos: int) -> HeldClaim | None:
        """Remove and return the claim whose run starts with keys[pos:] (or is their prefix)."""
        p = self._match(keys, pos)
        if p is not None:
            self._remove(p)
        return p

    def _remove(self, p: HeldClaim) -> None:
        runs = self._by_first[p.page_hexes[0]]
        runs.remove(p)
        if not runs:
            del self._by_first[p.page_hexes[0]]

    def take_starting_in(self, keys: list[str], owner: str | None) -> list[HeldClaim]:
        """`owner`'s prefetch over `keys` ended: it leaves every claim starting at one of them;
        returns the claims no request owns any more."""
        wanted = set(keys)
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

    def expire(self, now: float) -> list[HeldClaim]:
        """Claims whose lease may be over (the pull owns the lease): SGLang never collected them."""
        gone = [p for runs in self._by_first.values() for p in runs if p.conf.lease_over(now)]
        for p in gone:
            self._remove(p)
        return gone

    def drain(self) -> list[HeldClaim]:
        gone = [p for runs in self._by_first.values() for p in runs]
        self._by_first.clear()
        return gone

    def __len__(self) -> int:
        return sum(len(runs) for runs in self._by_first.values())
