"""A peer claim at the source, decided: the claim request answered with what it pins, a renewal,
the release answered with which claimed slots kept their bytes, leases ended by time.

Pure, like the destination's `Pull` (pull.py) beside it: the runner drives it under its lock with
`now` passed in, and a whole exchange runs in memory with both ends (tests/test_claim_exchange.py).
Where a pool's slots lie in the region is the caller's (`offset`), as are a page's bytes (`digest`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from . import messages as m
from .claims import Claim, ClaimTable, Release
from .keys import StorageKey
from .pool import PagePool


@dataclass(frozen=True, slots=True)
class Released:
    reply: m.Released
    expired: bool                   # the lease had ended it already: the answer came from its tombstone
    moved: tuple[StorageKey, ...]   # move mode: pages the puller verifiably received, still live here
    pool: str = ""                  # the claim's pool (where `moved` are to be removed)


class ClaimSource:
    def __init__(self, table: ClaimTable, *, default_lease_s: float) -> None:
        self.table = table
        self.default_lease_s = default_lease_s

    def claim(self, pool: PagePool, keys: Sequence[StorageKey], *, owner: str, lease_s: float | None,
              now: float) -> Claim:
        """Pin the leading READY pages of `keys` for `owner` (a claim of none is not kept)."""
        return self.table.claim(pool, keys, owner=owner, lease_s=lease_s or self.default_lease_s, now=now)

    def granted(self, claim: Claim, offsets: Sequence[int], digests: Sequence[int] = ()) -> m.Granted:
        """The answer to the claim: where each pinned page lies in the region (`offsets`), its slot
        generation, the lease, the pages' announces and, when asked, their commit `digests`."""
        pages = claim.pages
        return m.Granted(claim_id=claim.claim_id, offsets=list(offsets), generations=[p.generation for p in pages],
                         lease_s=claim.lease_s, digests=list(digests),
                         announces=[p.announce.to_wire() if p.announce else None for p in pages])

    def renew(self, claim_id: int, *, owner: str, now: float) -> m.Renewed:
        return m.Renewed(lease_s=self.table.renew(claim_id, owner=owner, now=now).lease_s)

    def release(self, claim_id: int, *, owner: str, drop: int = 0) -> Released:
        """End the claim (ClaimError when `owner` holds no such claim). `drop`: the puller received
        this many leading pages intact; those still live are named for removal (move mode)."""
        claim = self.table.peek(claim_id)
        result: Release = self.table.release(claim_id, owner=owner)
        moved = tuple(p.key for p, live in zip(claim.pages[:drop], result.live) if live) \
            if drop > 0 and claim is not None else ()
        return Released(m.Released(live=list(result.live)), result.expired, moved,
                        claim.pool.name if claim is not None else "")

    def expire(self, now: float, writer_alive: Callable[[int], bool] = lambda pid: False) -> list[int]:
        """End the claims and fills whose lease ran out; returns their ids."""
        return self.table.expire(now, writer_alive=writer_alive)
