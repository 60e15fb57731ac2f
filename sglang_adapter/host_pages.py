"""Copies between a runner's slots and SGLang's host pages: a read fills host pages with our pages
and then the ones peers confirmed (delivered straight into them and kept here too), a write backs
host pages up into fresh slots. KVCRStorage translates SGLang's calls into these."""

from __future__ import annotations

import logging
import math
import time

from kvcr.drivers.claim_holder import ClaimHolder
from kvcr.peer_pulls import PeerPulls
from kvcr.proto.announce import Announce
from kvcr.proto.events import EventError
from kvcr.proto.page import Page
from kvcr.proto.pool import PoolError
from kvcr.runner import Runner

from .layout import KeyLayout, gather, scatter
from .runner_setup import POOL
from .transfer_stats import TransferStats

log = logging.getLogger(__name__)


class HostPages:
    def __init__(self, runner: Runner, pulls: PeerPulls, claims: ClaimHolder | None, layouts: dict[str, KeyLayout],
                 stats: TransferStats) -> None:
        self.runner = runner
        self.pulls = pulls
        self.claims = claims
        self.layouts = layouts
        self.stats = stats

    def read(self, name: str, keys: list[str], host_indices, host_pool) -> list[bool]:
        """Leading pages of `name` into the host slots: ours first, then (KV) what peers confirmed."""
        start = time.perf_counter()
        layout, runner = self.layouts[name], self.runner
        segments = layout.key_segments(host_pool, host_indices, len(keys))
        # pages a peer confirmed are not asked of our pools (they are no local misses)
        local = self.claims.first_claimed(keys) if name == POOL and self.claims is not None else len(keys)
        with runner.pinned(name, runner.keys(name, keys[:local])) as pages:
            scatter([(runner.region_address + runner.offset(name, page.slot), segs)
                     for page, segs in zip(pages, segments)], layout.segment_bytes)
            n = len(pages)
        if name == POOL and self.claims is not None:
            n += self._pull_confirmed(keys, segments, n)
        self.stats.prefetched(n, start)
        return [i < n for i in range(len(keys))]

    def _pull_confirmed(self, keys: list[str], segments: list[list[int]], n: int) -> int:
        def keep(first: int, count: int, conf) -> None:
            try:
                announces = conf.announces()[:count]
            except EventError as exc:  # delivered to SGLang all the same; we just do not keep them
                log.warning("kvcr: pulled pages not kept: the source's announces are malformed: %s", exc)
                return
            # Pages a peer delivered into host pages are ours too (SGLang backs up only what it
            # computed): stored with the source's announces, so the next request hits here.
            if self.store(POOL, keys[first:first + count], segments[first:first + count], announces):
                self.pulls.count_pulled(count)

        delivered = self.claims.deliver(keys, segments, n, self.layouts[POOL].segment_bytes, on_delivered=keep)
        self.stats.from_peers(delivered)
        return delivered

    def write(self, name: str, keys: list[str], host_indices, host_pool,
              announces: list[Announce] | None = None) -> list[bool]:
        """Back up host pages; a key already present (or being written) counts as stored."""
        start = time.perf_counter()
        segments = self.layouts[name].key_segments(host_pool, host_indices, len(keys))
        ok = self.store(name, keys, segments, announces)
        self.stats.backed_up(len(keys), start)
        return [ok] * len(keys)

    def store(self, name: str, keys: list[str], segments: list[list[int]], announces) -> bool:
        """Copy host pages (their segments) into runner slots and commit them."""
        layout, runner = self.layouts[name], self.runner
        try:
            fill = runner.reserve(name, runner.keys(name, keys), announces, lease_s=math.inf)
        except (PoolError, EventError) as exc:  # no room, or announces the runner cannot use
            log.warning("kvcr: storing %d %s pages refused: %s", len(keys), name, exc)
            return False
        ok = True
        try:
            gather([(segs, runner.region_address + runner.offset(name, page.slot))
                    for page, segs in zip(fill.pages, segments) if isinstance(page, Page)], layout.segment_bytes)
        except BaseException:
            ok = False
            raise
        finally:
            runner.commit(fill.fill_id, None if ok else [False] * len(keys))
        return True
