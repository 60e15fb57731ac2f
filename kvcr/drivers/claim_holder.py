"""The destination side of a peer claim, from the lookup that takes it to the read that collects
it: confirm (claim at the source), hold, deliver, give back. The one owner of that lifecycle for
both SGLang backends and the runner's own pulls (kvcr/peer_pulls.py); the bookkeeping is
kvcr/proto/claim_ledger.py, the transfer the Puller's.

Every claim taken here ends on one of four paths, each a release at the source when nothing was
delivered: a read collects it (deliver ends it), the request's prefetch ends, its lease runs out
before anyone collects it, or the holder closes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

from ..proto.claim_ledger import ClaimLedger, HeldClaim
from ..proto.pull import PeerError

if TYPE_CHECKING:
    from ..proto.pull import PullResult
    from .puller import Confirmation, Puller

log = logging.getLogger(__name__)


class ClaimHolder:
    def __init__(self, make_puller: Callable[[], Puller], *, clock: Callable[[], float] = time.monotonic) -> None:
        """`make_puller`: called once, on the first claim (a sidecar rank opens its UCX worker only
        then); the ledger keeps count of ended prefetches before that."""
        self._make_puller = make_puller
        self._puller: Puller | None = None
        self._puller_lock = threading.Lock()
        self._clock = clock
        self._ledger = ClaimLedger()
        self._lock = threading.Lock()  # the ledger; never held while a source is asked
        self.num_expired = 0

    @property
    def puller(self) -> Puller:
        if self._puller is None:
            with self._puller_lock:
                if self._puller is None:
                    self._puller = self._make_puller()
        return self._puller

    @property
    def has_puller(self) -> bool:
        return self._puller is not None

    def ask_lease(self, lease_s: float) -> None:
        """Claims taken from now on ask their source to hold them this long (an SGLang backend's
        claims wait for a prefetch that may never collect them); 0: the source's default."""
        self.puller.lease_s = lease_s

    def covered(self, keys: list[str], start: int, owner: str | None) -> int:
        """`owner` (a request) looks up `keys` again: how far from `start` the claims it counts on
        reach (another rank's query, a retry, a prefix two requests share). Its grants count again
        (SGLang retries a prefetch under the same request id)."""
        with self._lock:
            self._ledger.started(owner)
            return self._ledger.covered(keys, start, owner)

    def confirm(self, endpoint: str, pool: str, keys: list[str], start: int, depth: int, owner: str | None, *,
                batch: int | None = None) -> int:
        """Claim keys[start:start + depth] at the source and hold what it grants for `owner`; with
        `batch`, one claim per batch of that many keys counted from the first key (SGLang reads in
        such batches, so each read collects one whole claim). Returns how far the claims reach."""
        got, end = start, start + depth
        while got < end:
            stop = end if batch is None else min(end, (got // batch + 1) * batch)
            try:
                conf = self.puller.confirm(endpoint, pool, keys[got:stop])
            except PeerError as exc:  # untrusted, or a namespace mismatch: nothing to load from it
                log.warning("kvcr: %s", exc)
                return got
            if conf is None:
                return got
            claim = HeldClaim(conf, keys[got:got + conf.num_pages], {owner})
            with self._lock:
                held = self._ledger.add(claim)
            if not held:  # granted after its prefetch ended: nobody will collect it
                self._give_back([claim])
                return got
            got += conf.num_pages
            if got < stop:
                return got
        return got

    def claim(self, endpoint: str, pool: str, page_hexes: Sequence[str], *, move: bool = False) -> HeldClaim | None:
        """Claim the leading pages at the source for a caller that collects them at once (the
        runner's own pulls): not held here, so `collect` or `give_back` must end it. None: a miss.
        `move`: the caller will ask the source to drop what it receives (no bytes inline)."""
        conf = self.puller.confirm(endpoint, pool, page_hexes, inline=not move)
        return None if conf is None else HeldClaim(conf, list(page_hexes[:conf.num_pages]))

    def collect(self, claim: HeldClaim, destinations: Sequence[int] | Sequence[Sequence[int]], *,
                segments: Sequence[int] | None = None, slice_offset: int = 0, move: bool = False) -> PullResult:
        """Move a claim's pages into `destinations` (see Puller.deliver); the claim ends whatever
        happens."""
        return self.puller.deliver(claim.conf, destinations, segments=segments, slice_offset=slice_offset, move=move)

    def give_back(self, claim: HeldClaim, *, wait: bool = True) -> None:
        """End a claim nothing will be delivered from (idempotent)."""
        self.puller.release(claim.conf, wait=wait)

    def first_claimed(self, keys: list[str]) -> int:
        """Where the first claim on exactly these keys starts (len(keys): none)."""
        with self._lock:
            return self._ledger.first_claimed(keys)

    def deliver(self, keys: list[str], segments: list[list[int]], n: int, segment_bytes: tuple[int, ...], *,
                slice_offset: int = 0, on_delivered: Callable[[int, int, Confirmation], None] | None = None) -> int:
        """GET the claimed pages from keys[n] on straight into host pages (a TP rank: its slice of
        each page). Returns the pages delivered whole, in order; `on_delivered(first, count,
        confirmation)` is told of each claim's whole pages as they arrive."""
        delivered = 0
        while n + delivered < len(keys):
            first = n + delivered
            claim = self.take(keys, first)  # only a claim on exactly these keys
            if claim is None:
                break
            want = min(len(claim.page_hexes), len(keys) - first)
            result = self.collect(claim, segments[first:first + want], segments=segment_bytes,
                                  slice_offset=slice_offset)
            if result.uncertain:
                # The data plane ends every transfer before it returns (a stuck lane's worker is
                # destroyed), so this is a failure like any other: nothing of it is delivered.
                log.error("kvcr: a peer transfer into host pages failed uncertainly (%s); none of it is used",
                          result.error)
                break
            if result.delivered and on_delivered is not None:
                on_delivered(first, result.delivered, claim.conf)
            delivered += result.delivered
            if result.delivered < want:
                break
        return delivered

    def take(self, keys: list[str], pos: int) -> HeldClaim | None:
        """Hand the claim on exactly keys[pos:] to a caller that delivers or releases it itself."""
        with self._lock:
            return self._ledger.take(keys, pos)

    def prefetch_ended(self, keys: Sequence[str], owner: str | None) -> None:
        """The scheduler stopped or revoked `owner`'s prefetch: give back the claims it will not
        collect and no other request counts on."""
        with self._lock:
            gone = self._ledger.take_starting_in(list(keys), owner)
        self._give_back(gone)

    def expire(self) -> int:
        """Give back claims whose lease may be over (SGLang never collected them); returns how many."""
        with self._lock:
            gone = self._ledger.expire(self._clock())
            self.num_expired += len(gone)
        self._give_back(gone)
        return len(gone)

    def close(self, *, puller: bool = False) -> None:
        """Give back every claim held; with `puller`, then close the puller `make_puller` made and
        its data plane (a holder that made its own, as a sidecar rank's)."""
        with self._lock:
            gone = self._ledger.drain()
        self._give_back(gone)
        if puller and self._puller is not None:
            self._puller.close()
            self._puller.plane.close()

    def _give_back(self, claims: list[HeldClaim]) -> None:
        for claim in claims:
            # Not waited for: the caller (the scheduler's prefetch-ended hook) must not wait on a
            # source's socket held by a transfer in flight; the puller's sender sends it.
            self.give_back(claim, wait=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ledger)
