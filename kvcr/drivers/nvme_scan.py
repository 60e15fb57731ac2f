"""The NVMe tier's startup scan: the inventory rebuilt from a directory, announced as it goes."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Protocol

from ..proto.disk_index import DiskEntry, DiskIndex, root_first
from .nvme_manifest import FORMAT_FILE, MANIFEST, MANIFEST_LOCK, ManifestRecords

log = logging.getLogger("kvcr.drivers.nvme")
SCAN_BATCH = 1024


class ScannedTier(Protocol):
    """What the scan uses of the tier it fills (kvcr/drivers/nvme.py's DiskTier)."""

    dir: Path
    page_bytes: int
    index: DiskIndex
    lock: threading.RLock
    flush: Callable[[], None]
    errors: Counter[str]
    stale_temp_age_s: float
    scan_done: threading.Event

    def path(self, name: str) -> Path: ...
    def is_page_name(self, stem: object) -> bool: ...
    def read_manifest(self) -> ManifestRecords: ...
    def compact_manifest(self) -> None: ...
    def count_error(self, exc: OSError) -> None: ...


class StartupScan:
    def __init__(self, tier: ScannedTier) -> None:
        self.tier = tier
        self.num_foreign = 0             # files in the directory that are no page of ours
        self.num_stale_temp_removed = 0  # temporary files writers that died left behind

    def run(self) -> None:
        """Rebuild the inventory from disk, announcing pages in batches as it goes.

        Pages we wrote are adopted roots first, so parents are announced before their children
        (a consumer that replays or takes a snapshot meanwhile sees whole chains); then the directory is swept for pages other programs wrote, abandoned
        temporary files and foreign files.
        """
        try:
            manifest = self.tier.read_manifest()
            found: list[DiskEntry] = []
            for name, (size, page_digest, announce) in manifest.items():
                if not self.tier.is_page_name(name):
                    self.tier.errors["manifest_record"] += 1
                    continue
                entry = self._check_file(name, size, DiskEntry(name, size, page_digest, announce))
                if entry is not None:
                    found.append(entry)
            ordered = root_first(found)
            for start in range(0, len(ordered), SCAN_BATCH):
                self._adopt_batch(ordered[start:start + SCAN_BATCH])
            batch: list[DiskEntry] = []
            with os.scandir(self.tier.dir) as it:
                for item in it:
                    try:
                        entry = self._sweep_entry(item, manifest)
                    except FileNotFoundError:  # a writer renamed or removed it meanwhile
                        continue
                    if entry is not None:
                        batch.append(entry)
                    if len(batch) >= SCAN_BATCH:
                        self._adopt_batch(batch)
            self._adopt_batch(batch)
            if self.num_stale_temp_removed:
                log.warning("nvme: removed %d temporary file(s) in %s left by writers that died",
                            self.num_stale_temp_removed, self.tier.dir)
            self.tier.compact_manifest()
        except OSError as exc:
            self.tier.count_error(exc)
            log.error("nvme scan of %s failed: %s", self.tier.dir, exc)
        finally:
            self.tier.scan_done.set()

    def _check_file(self, name: str, expected: int, entry: DiskEntry) -> DiskEntry | None:
        """The entry if its file is whole; a partial or wrong-sized file is removed and counted."""
        path = self.tier.path(name)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        if size != self.tier.page_bytes or size != expected:
            path.unlink(missing_ok=True)  # never served
            with self.tier.lock:
                self.tier.index.num_corrupt += 1
            return None
        return entry

    def _sweep_entry(self, item: os.DirEntry, manifest: dict) -> DiskEntry | None:
        name = item.name
        if name.endswith(".tmp"):
            if time.time() - item.stat().st_mtime >= self.tier.stale_temp_age_s:
                os.unlink(item.path)  # abandoned by a writer that died
                self.num_stale_temp_removed += 1
            return None
        stem = name[:-4]
        if not (name.endswith(".bin") and self.tier.is_page_name(stem)):
            if name not in (MANIFEST, MANIFEST_LOCK, FORMAT_FILE):
                self.num_foreign += 1
            return None
        if stem in manifest:
            return None  # handled in manifest order
        # Written by another program (HiCacheFile): no digest, no tokens; served, never announced.
        return self._check_file(stem, self.tier.page_bytes, DiskEntry(stem, self.tier.page_bytes, None, None))

    def _adopt_batch(self, batch: list[DiskEntry]) -> None:
        with self.tier.lock:
            for entry in batch:
                self.tier.index.adopt(entry)
            self.tier.index.touch([e.name for e in batch])  # each chain's tail is evicted before its head
        batch.clear()
        self.tier.flush()
