"""Claims and leases: who pins which pages until when. Time is passed in as `now`.

A claim pins pages of one pool against eviction until released or until its lease expires.
A fill reservation is the writer's twin: slots held FILLING until committed, aborted or expired.
An expired claim leaves a tombstone, so its late release still learns which pages stayed intact.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .announce import Announce
from .page import InFlight, Page
from .pool import PagePool, PoolError

TOMBSTONES = 4096
MAX_LEASE_S = 3600.0  # the longest lease a claim may ask for, and a grant may carry


class ClaimError(Exception):
    """A claim that does not exist, belongs to someone else, or has expired."""


class ClaimLimit(PoolError):
    """Granting the claim would pin more of the pool than `max_claim_fraction` allows."""


class Busy(PoolError):
    """The owner already holds `max_claims_per_owner` claims: back off (a destination treats it as a miss)."""


@dataclass(slots=True)
class Claim:
    claim_id: int
    owner: str
    pool: PagePool
    pages: list[Page]
    lease_s: float
    deadline: float


@dataclass(slots=True)
class Fill:
    fill_id: int
    owner: str
    pool: PagePool
    pages: list[Page | InFlight | None]
    lease_s: float
    deadline: float
    writer_pid: int = 0  # a same-host writer; while it lives its slots are never reused


@dataclass(frozen=True, slots=True)
class Release:
    """Per page: True when the slot still holds the claimed bytes (same generation, not reused)."""

    claim_id: int
    live: tuple[bool, ...]
    expired: bool = False


@dataclass(frozen=True, slots=True)
class ClaimStats:
    num_claims: int
    num_fills: int
    num_expired_claims: int
    num_expired_fills: int


@dataclass
class ClaimTable:
    max_claim_fraction: float = 0.5
    max_claims_per_owner: int = 0  # 0: unlimited
    _claims: dict[int, Claim] = field(default_factory=dict)
    _per_owner: dict[str, int] = field(default_factory=dict)
    _fills: dict[int, Fill] = field(default_factory=dict)
    _tombstones: OrderedDict[int, Claim] = field(default_factory=OrderedDict)
    _deadlines: list[tuple[float, int]] = field(default_factory=list)  # heap; stale entries skipped
    _next_id: int = 1
    num_expired_claims: int = 0
    num_expired_fills: int = 0

    def _new_id(self, deadline: float) -> int:
        self._next_id += 1
        heapq.heappush(self._deadlines, (deadline, self._next_id - 1))
        return self._next_id - 1

    # --- read claims ---------------------------------------------------------------------------

    def claim(self, pool: PagePool, keys: Sequence[str], *, owner: str, lease_s: float, now: float) -> Claim:
        """Pin the longest READY prefix of `keys`; the claim may hold zero pages (then it is not kept)."""
        held = self._per_owner.get(owner, 0)
        if self.max_claims_per_owner and held >= self.max_claims_per_owner:
            raise Busy(f"{owner!r} already holds {held} claims (max_claims_per_owner "
                       f"{self.max_claims_per_owner})")
        budget = int(pool.capacity * self.max_claim_fraction) - pool.num_claimed
        if budget <= 0 and pool.leading_ready(keys[:1]):
            raise ClaimLimit(f"pool {pool.name!r}: {pool.num_claimed} of {pool.capacity} pages already "
                             f"claimed (max_claim_fraction {self.max_claim_fraction})")
        pages = pool.pin_prefix(keys, max(budget, 0))  # it stops at the first page not READY
        if not pages:
            return Claim(0, owner, pool, [], lease_s, now)
        claim = Claim(self._new_id(now + lease_s), owner, pool, pages, lease_s, now + lease_s)
        self._claims[claim.claim_id] = claim
        self._per_owner[owner] = held + 1
        return claim

    def held(self, claim_id: int, owner: str) -> Claim:
        """The claim `owner` holds under this id; ClaimError otherwise."""
        return self._owned(claim_id, owner)

    def _owned(self, claim_id: int, owner: str) -> Claim:
        claim = self._claims.get(claim_id)
        if claim is None:
            raise ClaimError(f"claim {claim_id} is not held (released, or expired long ago)")
        if claim.owner != owner:
            raise ClaimError(f"claim {claim_id} belongs to {claim.owner!r}, not {owner!r}")
        return claim

    def fill(self, fill_id: int) -> Fill:
        fill = self._fills.get(fill_id)
        if fill is None:
            raise ClaimError(f"fill {fill_id} is not open (committed, aborted or expired)")
        return fill

    def peek(self, claim_id: int) -> Claim | None:
        """The held (or recently expired) claim with this id, without changing anything."""
        return self._claims.get(claim_id) or self._tombstones.get(claim_id)

    def renew(self, claim_id: int, *, owner: str, now: float) -> Claim:
        claim = self._owned(claim_id, owner)
        claim.deadline = now + claim.lease_s
        heapq.heappush(self._deadlines, (claim.deadline, claim_id))
        return claim

    def release(self, claim_id: int, *, owner: str) -> Release:
        """End a claim. After expiry this still answers (from a tombstone) with live flags."""
        tomb = self._tombstones.get(claim_id)
        if tomb is not None and tomb.owner == owner and claim_id not in self._claims:
            del self._tombstones[claim_id]
            return Release(claim_id, tuple(tomb.pool.is_live(p) for p in tomb.pages), expired=True)
        claim = self._owned(claim_id, owner)
        del self._claims[claim_id]
        left = self._per_owner.pop(owner) - 1
        if left:
            self._per_owner[owner] = left
        live = tuple(claim.pool.is_live(p) for p in claim.pages)
        claim.pool.unpin(claim.pages)
        return Release(claim_id, live)

    # --- fill reservations ----------------------------------------------------------------------

    def reserve(self, pool: PagePool, keys: Sequence[str], announces: Sequence[Announce | None] | None, *,
                owner: str, lease_s: float, now: float, writer_pid: int = 0, evict_dirty: bool = False) -> Fill:
        pages = pool.begin_fill(keys, announces, evict_dirty=evict_dirty)
        fill = Fill(self._new_id(now + lease_s), owner, pool, pages, lease_s, now + lease_s, writer_pid)
        self._fills[fill.fill_id] = fill
        return fill

    def commit(self, fill_id: int, *, owner: str, ok: Sequence[bool] | None, abort: bool = False,
               now: float = 0.0, clean: bool = False) -> int:
        fill = self._fills.get(fill_id)
        if fill is None or fill.owner != owner:
            raise ClaimError(f"fill {fill_id} is not held by {owner!r} (committed, aborted or expired)")
        n = fill.pool.commit_fill(fill.pages, [False] * len(fill.pages) if abort else ok, now=now,
                                  clean=clean)  # validates first
        del self._fills[fill_id]
        return n

    def quarantine(self, fill_id: int, *, owner: str) -> int:
        """End a fill whose slots may still be written: see PagePool.quarantine_fill."""
        fill = self._fills.get(fill_id)
        if fill is None or fill.owner != owner:
            raise ClaimError(f"fill {fill_id} is not held by {owner!r} (committed, aborted or expired)")
        del self._fills[fill_id]
        return fill.pool.quarantine_fill(fill.pages)

    # --- time ------------------------------------------------------------------------------------

    def expire(self, now: float, writer_alive: Callable[[int], bool] = lambda pid: False) -> list[int]:
        """End every claim and fill whose deadline passed; returns their ids.

        A fill whose writer process is still alive is extended instead: aborting it would hand
        its slots to another page while the writer may still be copying into them.
        """
        gone = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, item_id = heapq.heappop(self._deadlines)
            claim = self._claims.get(item_id)
            if claim is not None and claim.deadline <= now:
                self.release(item_id, owner=claim.owner)
                self._tombstones[item_id] = claim
                if len(self._tombstones) > TOMBSTONES:
                    self._tombstones.popitem(last=False)
                self.num_expired_claims += 1
                gone.append(item_id)
            fill = self._fills.get(item_id)
            if fill is not None and fill.deadline <= now:
                if fill.writer_pid and writer_alive(fill.writer_pid):
                    fill.deadline = now + fill.lease_s
                    heapq.heappush(self._deadlines, (fill.deadline, item_id))
                    continue
                self.commit(item_id, owner=fill.owner, ok=None, abort=True)
                self.num_expired_fills += 1
                gone.append(item_id)
        return gone

    def next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    def statistics(self) -> ClaimStats:
        return ClaimStats(len(self._claims), len(self._fills), self.num_expired_claims, self.num_expired_fills)
