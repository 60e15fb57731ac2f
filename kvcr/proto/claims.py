"""Claims and leases: who pins which pages until when. Time is passed in as `now`.

A claim pins pages of one pool against eviction until released or until its lease expires.
A fill reservation is the writer's twin: slots held FILLING until committed, aborted or expired.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .announce import Announce
from .pool import Page, PagePool, PoolError


class ClaimError(Exception):
    """A claim that does not exist, belongs to someone else, or has expired."""


class ClaimLimit(PoolError):
    """Granting the claim would pin more of the pool than `max_claim_fraction` allows."""


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
    pages: list[Page | None]
    lease_s: float
    deadline: float
    writer_pid: int = 0  # a same-host writer; while it lives its slots are never reused


@dataclass(frozen=True, slots=True)
class Release:
    """Per page: True when the bytes stayed in place for the whole claim."""

    claim_id: int
    live: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class ClaimStats:
    num_claims: int
    num_fills: int
    num_expired_claims: int
    num_expired_fills: int


@dataclass
class ClaimTable:
    max_claim_fraction: float = 0.5
    _claims: dict[int, Claim] = field(default_factory=dict)
    _fills: dict[int, Fill] = field(default_factory=dict)
    _next_id: int = 1
    num_expired_claims: int = 0
    num_expired_fills: int = 0

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # --- read claims ---------------------------------------------------------------------------

    def claim(self, pool: PagePool, keys: Sequence[str], *, owner: str, lease_s: float, now: float) -> Claim:
        """Pin the longest READY prefix of `keys`; the claim may hold zero pages (then it is not kept)."""
        budget = int(pool.capacity * self.max_claim_fraction) - pool.num_claimed
        available = pool.leading_ready(keys)
        if available and budget <= 0:
            raise ClaimLimit(f"pool {pool.name!r}: {pool.num_claimed} of {pool.capacity} pages already "
                             f"claimed (max_claim_fraction {self.max_claim_fraction})")
        pages = pool.pin_prefix(keys, min(available, max(budget, 0)))
        claim = Claim(self._new_id(), owner, pool, pages, lease_s, now + lease_s)
        if pages:
            self._claims[claim.claim_id] = claim
        return claim

    def _owned(self, claim_id: int, owner: str) -> Claim:
        claim = self._claims.get(claim_id)
        if claim is None:
            raise ClaimError(f"claim {claim_id} is not held (released or expired)")
        if claim.owner != owner:
            raise ClaimError(f"claim {claim_id} belongs to {claim.owner!r}, not {owner!r}")
        return claim

    def renew(self, claim_id: int, *, owner: str, now: float) -> float:
        claim = self._owned(claim_id, owner)
        claim.deadline = now + claim.lease_s
        return claim.deadline

    def release(self, claim_id: int, *, owner: str) -> Release:
        claim = self._owned(claim_id, owner)
        del self._claims[claim_id]
        live = tuple(claim.pool.is_live(p) for p in claim.pages)
        claim.pool.unpin(claim.pages)
        return Release(claim_id, live)

    def release_owner(self, owner: str) -> int:
        """Release everything `owner` holds (a peer that went away). Returns claims released."""
        ids = [c.claim_id for c in self._claims.values() if c.owner == owner]
        for claim_id in ids:
            self.release(claim_id, owner=owner)
        for fill_id in [f.fill_id for f in self._fills.values() if f.owner == owner]:
            self.commit(fill_id, owner=owner, ok=None, abort=True)
        return len(ids)

    # --- fill reservations ----------------------------------------------------------------------

    def reserve(self, pool: PagePool, keys: Sequence[str], announces: Sequence[Announce | None] | None, *,
                owner: str, lease_s: float, now: float, writer_pid: int = 0) -> Fill:
        pages = pool.begin_fill(keys, announces)
        fill = Fill(self._new_id(), owner, pool, pages, lease_s, now + lease_s, writer_pid)
        self._fills[fill.fill_id] = fill
        return fill

    def commit(self, fill_id: int, *, owner: str, ok: Sequence[bool] | None, abort: bool = False) -> int:
        fill = self._fills.get(fill_id)
        if fill is None or fill.owner != owner:
            raise ClaimError(f"fill {fill_id} is not held by {owner!r} (committed, aborted or expired)")
        del self._fills[fill_id]
        if abort:
            ok = [False] * len(fill.pages)
        return fill.pool.commit_fill(fill.pages, ok)

    # --- time ------------------------------------------------------------------------------------

    def expire(self, now: float, writer_alive: Callable[[int], bool] = lambda pid: False) -> list[int]:
        """End every claim and fill whose deadline passed; returns their ids.

        A fill whose writer process is still alive is extended instead: aborting it would hand
        its slots to another page while the writer may still be copying into them.
        """
        gone = [c for c in self._claims.values() if c.deadline <= now]
        for claim in gone:
            self.release(claim.claim_id, owner=claim.owner)
        late = []
        for fill in [f for f in self._fills.values() if f.deadline <= now]:
            if fill.writer_pid and writer_alive(fill.writer_pid):
                fill.deadline = now + fill.lease_s
            else:
                late.append(fill)
        for fill in late:
            self.commit(fill.fill_id, owner=fill.owner, ok=None, abort=True)
        self.num_expired_claims += len(gone)
        self.num_expired_fills += len(late)
        return [c.claim_id for c in gone] + [f.fill_id for f in late]

    def next_deadline(self) -> float | None:
        deadlines = [c.deadline for c in self._claims.values()] + [f.deadline for f in self._fills.values()]
        return min(deadlines, default=None)

    def statistics(self) -> ClaimStats:
        return ClaimStats(len(self._claims), len(self._fills), self.num_expired_claims, self.num_expired_fills)
