"""A runner's peer pulls, destination side: the hints posted to it and pulls into fresh DRAM slots.

The runner owns DRAM residency; this owns what comes from peers. A claim is taken, collected and
given back through the ClaimHolder (the one owner of a destination's claims); here its pages get
slots, are committed when delivered, and are quarantined when the transfer was uncertain.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .proto.events import EventError
from .proto.hintbook import HintBook, HintedSource
from .proto.hints import FetchHint
from .proto.keys import hash_str_to_int64
from .proto.page import Page
from .proto.pool import PoolError
from .proto.pull import NoPuller
from .runner import Runner

if TYPE_CHECKING:
    from .drivers.claim_holder import ClaimHolder
    from .drivers.puller import Puller
    from .proto.claim_ledger import HeldClaim


@dataclass(frozen=True, slots=True)
class PullStatistics:
    pulled: int               # pages peers delivered into DRAM (or an engine's host pages)
    uncertain: int            # slots quarantined after an uncertain transfer
    digest_mismatches: int
    unreachable: int          # claims or info requests a peer did not answer
    skipped_unreachable: int  # pulls not tried: the source was backing off
    recovered: int            # back-offs ended early: a probe found the source answering again
    refused_untrusted: int
    hinted_hashes: int        # block hashes held from posted hints
    inline: int = 0           # pages delivered out of a claim's answer (small pulls: no GETs)


class PeerPulls:
    def __init__(self, runner: Runner, claims: ClaimHolder | None) -> None:
        """`claims`: None when the runner has no UCX data plane (nothing is pulled)."""
        self.runner = runner
        self.claims = claims
        cfg = runner.cfg.runner
        self._hints = HintBook(ttl_s=cfg.hint_ttl_s, max_hashes=cfg.max_hinted_hashes)
        self._lock = threading.Lock()  # the hint book and the counters
        self._pulled = 0
        self._uncertain = 0

    @property
    def puller(self) -> Puller | None:
        return self.claims.puller if self.claims is not None else None

    # --- hints ------------------------------------------------------------------------------------

    def post_hint(self, hint: FetchHint) -> None:
        with self._lock:
            self._hints.post(hint, self.runner.clock())

    def hinted_source(self, event_hashes: Sequence[int]) -> HintedSource | None:
        with self._lock:
            return self._hints.source_for(list(event_hashes), self.runner.clock())

    def housekeeping(self) -> None:
        with self._lock:
            self._hints.expire(self.runner.clock())

    # --- pulls ------------------------------------------------------------------------------------

    def pull_requested(self, pool: str, page_hexes: Sequence[str], *, source: str = "",
                       event_hashes: Sequence[int] = ()) -> int:
        """The control op `pull`: from `source`, else from the source a posted hint names (moving
        the pages when the hint says so). Returns how many leading pages are now local."""
        if self.claims is None:
            raise NoPuller("this runner has no UCX data plane (runner.ucx = false)")
        move = False
        if not source:
            hinted = self.hinted_source(event_hashes or [hash_str_to_int64(h) for h in page_hexes])
            if hinted is None:
                return self.runner.lookup(pool, self.runner.keys(pool, page_hexes))
            source, move, page_hexes = hinted.endpoint, hinted.mode == "move", page_hexes[:hinted.num_pages]
        return self.pull_from(source, pool, page_hexes, move=move)

    def pull_from(self, endpoint: str, pool: str, page_hexes: Sequence[str], *, move: bool = False) -> int:
        """Make the leading run of `page_hexes` local, pulling what we lack from the peer at
        `endpoint` straight into fresh DRAM slots. Returns how many leading pages are now local."""
        runner = self.runner
        keys = runner.keys(pool, page_hexes)
        have = runner.lookup(pool, keys)
        if have == len(keys) or self.claims is None:
            return have
        claim = self.claims.claim(endpoint, pool, page_hexes[have:], move=move)
        if claim is not None:
            self.take_confirmed(claim, move=move)
        return runner.lookup(pool, keys)

    def take_confirmed(self, claim: HeldClaim, *, move: bool = False) -> int:
        """Pull the pages of a claim a source granted us into fresh DRAM slots and commit them;
        the claim ends on every path. Returns the leading pages delivered."""
        assert self.claims is not None, "a claim without a data plane"
        runner, conf = self.runner, claim.conf
        keys = runner.keys(conf.pool, claim.page_hexes[:conf.num_pages])
        try:
            fill = runner.reserve(conf.pool, keys, conf.announces(), lease_s=math.inf)
        except (PoolError, EventError):  # no room, or a source sent announces we cannot use
            self.claims.give_back(claim)
            return 0
        slots = list(itertools.takewhile(lambda p: isinstance(p, Page), fill.pages))
        result = None
        try:
            result = self.claims.collect(claim, [runner.region_address + runner.offset(conf.pool, p.slot)
                                                 for p in slots], move=move)
        finally:
            if result is None or result.uncertain:
                # The transfer may still write into these slots: never hand them out again.
                quarantined = runner.quarantine(fill.fill_id)
                with self._lock:
                    self._uncertain += quarantined
            else:
                committed = runner.commit(fill.fill_id, [i < result.delivered for i in range(len(fill.pages))])
                self.count_pulled(committed)
        return result.delivered if result is not None and not result.uncertain else 0

    def count_pulled(self, pages: int) -> None:
        """Pages a peer delivered (into DRAM, or into an engine's host pages it then stored here)."""
        with self._lock:
            self._pulled += pages

    def statistics(self) -> PullStatistics:
        p = self.puller
        with self._lock:
            return PullStatistics(self._pulled, self._uncertain, p.num_digest_mismatches if p else 0,
                                  p.reach.num_failures if p else 0, p.reach.num_skipped if p else 0,
                                  p.reach.num_recovered if p else 0, p.num_refused_untrusted if p else 0,
                                  len(self._hints), p.num_inline_pages if p else 0)

    def close(self) -> None:
        if self.claims is not None:
            self.claims.close()
            self.claims.puller.close()
