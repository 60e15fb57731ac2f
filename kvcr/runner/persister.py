"""Persister: the thread that writes DRAM pages to the NVMe tier, off the request path.

`write_behind` writes every committed page, oldest first, as soon as it gets to it; `spill`
writes only the pages eviction wants next (DRAM above its high watermark, or a fill waiting).
Which page is DIRTY or CLEAN is PagePool's state; NvmeTier (nvme_tier.py) owns the tier and
decides; this thread only moves bytes between DRAM and NVMe. Design notes: docs/nvme.md.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping

from ..drivers.nvme import DiskTier, Written
from ..proto.page import Keep
from .lower import DramSide

log = logging.getLogger(__name__)
SPILL = "spill"  # nvme.write_policy values are validated in kvcr/config.py
_KEEP = {Written.WRITTEN: Keep.CLEAN, Written.PRESENT: Keep.CLEAN, Written.FULL: Keep.LOWER_FULL,
         Written.FAILED: Keep.WRITE_FAILED}


class Persister:
    def __init__(self, dram: DramSide, disks: Mapping[str, DiskTier], *, spill_demand: Callable[[str], int],
                 settled: Callable[[], None], policy: str, batch: int) -> None:
        self.dram = dram
        self.disks = disks
        self._spill_demand = spill_demand  # the tier's: what eviction wants written next (under the lock)
        self._settled = settled            # the tier's: a batch settled, waiting fills may find room
        self.policy = policy
        self.batch = batch
        self.wake = threading.Event()
        self.num_written = 0
        self.num_skipped = 0  # on NVMe already: not rewritten
        self.num_refused: dict[str, int] = {}
        self._flushing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcr-nvme-persist", daemon=True)

    def start(self) -> "Persister":
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.wake.wait(0.05)
            self.wake.clear()
            try:
                while self.write_once() and not self._stop.is_set():
                    pass
            except Exception:  # logged and retried: a failed pass must not stop persistence
                log.exception("nvme persist pass failed")
                time.sleep(0.1)

    def write_once(self) -> int:
        """One batch per pool that has work; returns pages handled."""
        return sum(self._write_pool(name) for name in self.disks)

    def _write_pool(self, name: str) -> int:
        dram, disk = self.dram, self.disks[name]
        pool = dram.pool(name)
        batch = min(self.batch, max(1, pool.capacity // 4))  # never pin most of DRAM at once
        with dram.lock:
            if self.policy == SPILL and not self._flushing:
                pages = pool.take_dirty(min(batch, self._spill_demand(name)), lru=True)
            else:
                pages = pool.take_dirty(batch)
            if not pages:
                return 0
            present = [disk.name(p.key.page_hex) in disk.index for p in pages]
        todo = [p for p, here in zip(pages, present) if not here]
        outcomes: dict[int, Written] = {}
        try:
            if todo:
                written = disk.write_pages([p.key.page_hex for p in todo], [dram.slot_view(name, p) for p in todo],
                                           [p.announce for p in todo])
                outcomes = {id(p): w for p, w in zip(todo, written)}
        finally:
            keeps = [Keep.CLEAN if here else _KEEP[outcomes.get(id(p), Written.FAILED)]
                     for p, here in zip(pages, present)]
            with dram.lock:
                pool.settle_written(pages, keeps)
                self._count(len(pages) - len(todo), [outcomes.get(id(p), Written.FAILED) for p in todo])
                self._settled()
                dram.flush_events()
        return len(pages)

    def _count(self, skipped: int, outcomes: list[Written]) -> None:
        self.num_skipped += skipped
        for w in outcomes:
            if w is Written.WRITTEN:
                self.num_written += 1
            elif w is Written.PRESENT:
                self.num_skipped += 1
            else:
                self.num_refused[w.value] = self.num_refused.get(w.value, 0) + 1

    def flush(self, timeout_s: float) -> tuple[int, int]:
        """Write every dirty page (either policy) within `timeout_s`; returns (written, left)."""
        self._flushing = True  # the thread, too, now writes whatever is dirty
        deadline = time.monotonic() + timeout_s
        before = self.num_written
        try:
            while time.monotonic() < deadline:
                if not self.write_once():
                    if not self._num_dirty():
                        break
                    time.sleep(0.01)  # the thread holds the rest: wait for its batch
        finally:
            self._flushing = False
        return self.num_written - before, self._num_dirty()

    def _num_dirty(self) -> int:
        with self.dram.lock:
            return sum(self.dram.pool(n).num_dirty for n in self.disks)

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread.is_alive():
            self._thread.join(10)
