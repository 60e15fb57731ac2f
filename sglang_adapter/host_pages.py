"""Copies between a runner's slots and SGLang's host pages: a read fills host pages with our pages
and then the ones peers confirmed (delivered straight into them, then kept here too, behind the
read: keeper.py), a write backs host pages up into fresh slots. KVCRStorage translates SGLang's
calls into these."""

from __future__ import annotations

import functools
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

from .keeper import Keeper
from .layout import KeyLayout, gather, scatter
from .runner_setup import POOL
from .transfer_stats import TransferStats

log = logging.getLogger(__name__)


class HostPages:
    def __init__(self, runner: Runner, pulls: PeerPulls, claims: ClaimHolder | None, layouts: dict[str, KeyLayout],
                 stats: TransferStats, keeper: Keeper, anchor: object | None = None) -> None:
        self.runner = runner
        self.pulls = pulls
        self.claims = claims
        self.layouts = layouts
        self.stats = stats
        self.keeper = keeper  # copies what peers delivered into the runner, after the read
        self.anchor = anchor  # the host pool registered first: a plain model's KV pool

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
            n += self._pull_confirmed(keys, segments, n, host_pool, host_indices)
        self.stats.prefetched(n, start)
        return [i < n for i in range(len(keys))]

    def _defers_keeps(self, host_pool) -> bool:
        """Whether keeps may run after the read: only for a plain model's own KV pool. A hybrid
        model's pools are allocated through its anchor, and a shared (SWA) layout moves live pages
        when it compacts (0.5.23 on; the attribute is absent before): those keep during the read."""
        return host_pool is self.anchor and getattr(host_pool, "shared_allocation_domain", None) is None

    def _pull_confirmed(self, keys: list[str], segments: list[list[int]], n: int, host_pool, host_indices) -> int:
        arrived = []  # (first, count, confirmation) per claim delivered

        def on_delivered(first: int, count: int, conf) -> None:
            self.pulls.count_pulled(count)
            arrived.append((first, count, conf))

        delivered = self.claims.deliver(keys, segments, n, self.layouts[POOL].segment_bytes,
                                        on_delivered=on_delivered)
        self.stats.from_peers(delivered)
        if not self._defers_keeps(host_pool):
            for first, count, conf in arrived:
                self._keep(keys[first:first + count], segments[first:first + count], conf)
            return delivered
        self.keeper.guard(host_pool)
        per_key = len(host_indices) // len(keys)
        # Queued once every claim is in: a keep running beside a later claim's copy would slow it.
        for first, count, conf in arrived:
            job = functools.partial(self._keep, keys[first:first + count], segments[first:first + count], conf)
            try:
                self.keeper.submit(job, (host_pool, host_indices[first * per_key:(first + count) * per_key]))
            except RuntimeError as exc:  # the backend is closing: delivered to SGLang, not kept here
                log.info("kvcr: %d pulled pages not kept: %s", count, exc)
        return delivered

    def _keep(self, keys: list[str], segments: list[list[int]], conf) -> None:
        """Pages a peer delivered into host pages are ours too (SGLang backs up only what it
        computed): stored with the source's announces, so the next request hits here."""
        try:
            announces = conf.announces()[:len(keys)]
        except EventError as exc:  # delivered to SGLang all the same; we just do not keep them
            log.warning("kvcr: pulled pages not kept: the source's announces are malformed: %s", exc)
            return
        self.store(POOL, keys, segments, announces)

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
