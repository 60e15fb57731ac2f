"""The NVMe tier behind DRAM: promotion, write-through, back-pressure on fills, the shutdown flush.

A `LowerTier` (lower.py). Whether a DRAM page is DIRTY or CLEAN is PagePool state, so this owner
works under the DRAM side's lock (`dram.lock`, which the disk indexes share); it takes it
explicitly, never holds it while moving bytes, and its persister thread (persister.py) does the
writing. Design notes: docs/nvme.md.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from typing import Sequence

from ..config import NvmeConfig
from ..drivers.nvme import DiskTier
from ..proto.disk_index import DiskIndex, DiskStats
from ..proto.events import Event
from ..proto.keys import Namespace, StorageKey
from ..proto.page import Keep, Page
from ..proto.pool import PoolBusy, PoolError
from .lower import DiskStatistics, DramSide, TieringStatistics
from .persister import Persister

log = logging.getLogger(__name__)


class NvmeTier:
    """The NVMe tier of every pool named in `pools` (pool name -> (namespace, page bytes))."""

    def __init__(self, dram: DramSide, cfg: NvmeConfig, pools: dict[str, tuple[Namespace, int]], *,
                 block_size: int) -> None:
        self.dram = dram
        self.cfg = cfg
        self.block_size = block_size
        self.disks: dict[str, DiskTier] = {name: self._disk_tier(ns, page_bytes)
                                           for name, (ns, page_bytes) in pools.items()}
        self.pools = frozenset(self.disks)
        self.written = threading.Condition(dram.lock)  # the persister settled a batch: room may exist
        self._fill_demand: Counter[str] = Counter()  # pages waiting fills need evicted (spill writes them)
        self.num_fill_waits = 0
        self.fill_wait_s = 0.0
        self.num_promoted = 0
        self.shutdown_flush: tuple[float, int, int] | None = None
        self.persister = self._new_persister().start()

    def _disk_tier(self, namespace: Namespace, page_bytes: int) -> DiskTier:
        n = self.cfg
        index = DiskIndex(block_size=self.block_size, max_bytes=n.max_size, high_watermark=n.high_watermark,
                          low_watermark=n.low_watermark)
        return DiskTier(n.storage_dir, namespace, page_bytes=page_bytes, index=index,
                        lock=self.dram.lock, flush=self.dram.flush_events_locked, read_workers=n.read_workers,
                        write_workers=n.write_workers, fsync=n.fsync, min_free_space=n.min_free_space,
                        stale_temp_age_s=n.stale_temp_age_s, verify=n.verify)

    def _new_persister(self) -> Persister:
        return Persister(self.dram, self.disks, spill_demand=self.spill_demand, settled=self.settled,
                         policy=self.cfg.write_policy, batch=self.cfg.write_batch)

    # --- back-pressure (called by Runner.reserve, under the lock) -------------------------------

    def wait_for_writer(self, pool: str, busy: PoolBusy, deadline: float | None) -> float:
        """Wait (lock released) until the persister settles a batch or the deadline passes; returns
        the deadline, after which the fill may evict dirty pages (counted under `nvme_lagging`)."""
        if deadline is None:
            deadline = time.monotonic() + self.cfg.dirty_wait_s
            self.num_fill_waits += 1
        left = deadline - time.monotonic()
        if left > 0:
            self._fill_demand[pool] += busy.shortfall
            self.persister.wake.set()
            try:
                self.written.wait(left)
            finally:
                self._fill_demand[pool] -= busy.shortfall
        else:
            log.warning("pool %r: the NVMe writer is behind; dropping up to %d dirty pages after %.1f s",
                        pool, busy.shortfall, self.cfg.dirty_wait_s)
        return deadline

    def waited(self, deadline: float) -> None:
        """A fill that waited for the writer got its slots (its wait began at deadline - dirty_wait_s)."""
        self.fill_wait_s += time.monotonic() - deadline + self.cfg.dirty_wait_s

    def spill_demand(self, pool: str) -> int:
        """Pages the spill policy should write now: what eviction wants next (under the lock)."""
        return max(self.dram.pool(pool).over_watermark(), self._fill_demand[pool])

    def settled(self) -> None:
        """The persister settled a batch (under the lock): waiting fills look for room again."""
        self.written.notify_all()

    def committed(self) -> None:
        """Dirty pages were committed: the persister has work."""
        self.persister.wake.set()

    # --- reads ---------------------------------------------------------------------------------

    def on_disk(self, pool: str, keys: Sequence[StorageKey]) -> list[bool]:
        """Per key: is the page on NVMe (under the lock)."""
        disk = self.disks.get(pool)
        return [disk is not None and disk.name(k.page_hex) in disk.index for k in keys]

    def complete_run(self, pool: str, keys: Sequence[StorageKey]) -> None:
        """Promote the NVMe run that continues the DRAM run; the DRAM run stays pinned meanwhile,
        so making room never evicts the head of the chain being completed."""
        if pool not in self.disks or not self.cfg.promote:
            return
        dram = self.dram
        with dram.lock:
            p = dram.pool(pool)
            head = p.pin_prefix(keys, len(keys))
        try:
            if len(head) < len(keys):
                self.promote(pool, keys[len(head):])
        finally:
            with dram.lock:
                p.unpin(head)

    def promote(self, pool: str, keys: Sequence[StorageKey]) -> int:
        """Copy the leading run of `keys` found on NVMe into DRAM. Returns pages promoted."""
        dram, disk = self.dram, self.disks[pool]
        hexes = [k.page_hex for k in keys]
        n = disk.present(hexes)
        if not n:
            return 0
        with dram.lock:
            announces = [e.announce if e is not None else None
                         for e in (disk.index.get(disk.name(h)) for h in hexes[:n])]
        try:
            fill = dram.reserve(pool, keys[:n], announces, lease_s=math.inf)
        except PoolError:
            return 0  # no room even after eviction: serve what DRAM has
        ok = [True] * n
        todo = [(i, p) for i, p in enumerate(fill.pages) if isinstance(p, Page)]
        try:
            got = disk.read_into([hexes[i] for i, _ in todo], [dram.slot_view(pool, p) for _, p in todo])
            for j, (i, _) in enumerate(todo):
                ok[i] = j < got
        except BaseException:
            ok = [False] * n
            raise
        finally:
            committed = dram.commit(fill.fill_id, ok, clean=True)
        with dram.lock:
            dram.pool(pool).mark_clean(keys[:n])  # pages another fill committed meanwhile: NVMe has them
            self.num_promoted += committed
        return next((i for i, good in enumerate(ok) if not good), n)

    def persist(self, pool: str, keys: Sequence[StorageKey]) -> int:
        """Write DRAM pages to NVMe now (write-through); returns pages on NVMe afterwards."""
        dram, disk = self.dram, self.disks[pool]
        with dram.pinned(pool, keys) as pages:
            results = disk.write([pg.key.page_hex for pg in pages], [dram.slot_view(pool, pg) for pg in pages],
                                 [pg.announce for pg in pages])
            with dram.lock:
                dram.pool(pool).mark_clean([pg.key for pg, ok in zip(pages, results) if ok])
        return sum(results)

    # --- inventory -----------------------------------------------------------------------------

    def take_events(self) -> list[Event]:
        """The disk indexes' pending events (under the lock); DRAM copies of pages NVMe let go
        lose their keeper first, so evicting them later counts them as dropped."""
        for name, disk in self.disks.items():
            dropped = disk.index.take_dropped()
            if dropped:
                keys = self.dram.keys(name, [disk.page_hex(n) for n in dropped])
                self.dram.pool(name).mark_unkept(keys, Keep.LOWER_EVICTED)
                self.dram.pool(name).remember(keys)  # held here once, even if DRAM never had it
        return [e for disk in self.disks.values() for e in disk.index.take_events()]

    def inventory(self) -> list[Event]:
        return [e for disk in self.disks.values() for e in disk.index.inventory()]

    def holds_event_hash(self, event_hash: int) -> bool:
        return any(disk.index.name_for_event_hash(event_hash) is not None for disk in self.disks.values())

    def page_hexes(self, pool: str) -> list[str]:
        """Every page on the pool's NVMe tier (under the lock)."""
        disk = self.disks.get(pool)
        return [disk.page_hex(e.name) for e in disk.index.entries()] if disk is not None else []

    def remove(self, pool: str, page_hexes: Sequence[str]) -> int:
        disk = self.disks.get(pool)
        return disk.remove(page_hexes) if disk is not None else 0

    def evicted(self) -> dict[str, int]:
        """Pages each pool's NVMe tier evicted; it is the last tier, so each one is dropped (under the lock)."""
        return {name: disk.index.num_evicted for name, disk in self.disks.items()}

    def start_scans(self) -> list[threading.Thread]:
        return [disk.start_scan() for disk in self.disks.values()]

    # --- housekeeping and shutdown ---------------------------------------------------------------

    def housekeeping(self) -> None:
        """NVMe watermark eviction (one pass); a persister thread that died is restarted."""
        for disk in self.disks.values():
            disk.evict_to_watermark()
        if not self.persister.is_alive():
            log.error("the NVMe persister thread is gone; restarting it")
            self.persister = self._new_persister().start()

    def healthy(self) -> bool:
        return self.persister.is_alive()

    def flush(self) -> tuple[float, int, int]:
        """Write every dirty DRAM page to NVMe within nvme.flush_timeout_s (at shutdown); returns
        (seconds, pages written, pages left) and logs what did not make it."""
        t0 = time.monotonic()
        written, left = self.persister.flush(self.cfg.flush_timeout_s)
        self.shutdown_flush = (time.monotonic() - t0, written, left)
        if left:
            log.warning("NVMe flush at shutdown: %d dirty pages not written within nvme.flush_timeout_s = %.1f s "
                        "(lost with DRAM)", left, self.cfg.flush_timeout_s)
        elif written:
            log.info("NVMe flush at shutdown: %d pages written in %.2f s", written, self.shutdown_flush[0])
        return self.shutdown_flush

    def close(self) -> None:
        """Stop the writer and close the files; the indexes forget (under the lock) what a
        restarted runner re-announces from the files."""
        self.persister.stop()
        for disk in self.disks.values():
            disk.close()
        with self.dram.lock:
            for disk in self.disks.values():
                disk.index.clear()

    def index_statistics(self, pool: str) -> DiskStats | None:
        """The pool's disk index counters (under the lock); None for a pool this tier does not keep."""
        disk = self.disks.get(pool)
        return disk.index.statistics() if disk is not None else None

    def statistics(self) -> TieringStatistics:
        """Counters (under the lock)."""
        p = self.persister
        return TieringStatistics(p.num_written, p.num_skipped, tuple(sorted(p.num_refused.items())),
                                 self.num_promoted, self.num_fill_waits, self.fill_wait_s, self.shutdown_flush,
                                 tuple((name, _disk_statistics(disk)) for name, disk in self.disks.items()))


def _disk_statistics(disk: DiskTier) -> DiskStatistics:
    def hist(h) -> tuple[tuple[float, ...], tuple[int, ...], float]:
        return tuple(h.bounds), tuple(h.counts), h.total
    return DiskStatistics(disk.num_foreign, tuple(sorted(disk.errors.items())), hist(disk.read_latency),
                          hist(disk.write_latency))
