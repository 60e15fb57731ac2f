"""What SGLang's `get_stats` reports of a backend: pages prefetched and backed up since the last
report, how fast, and how many came from peers (thread-safe: SGLang's threads count at once)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Window:
    prefetch_pages: int = 0
    backup_pages: int = 0
    peer_pages: int = 0
    prefetch_seconds: float = 0.0
    backup_seconds: float = 0.0


class TransferStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._window = Window()

    def from_peers(self, pages: int) -> None:
        with self._lock:
            self._window.peer_pages += pages

    def prefetched(self, pages: int, started: float) -> None:
        """`pages` read into the host pool by a call that began at `started` (perf_counter)."""
        elapsed = time.perf_counter() - started
        with self._lock:
            self._window.prefetch_pages += pages
            self._window.prefetch_seconds += elapsed

    def backed_up(self, pages: int, started: float) -> None:
        elapsed = time.perf_counter() - started
        with self._lock:
            self._window.backup_pages += pages
            self._window.backup_seconds += elapsed

    def report(self, page_bytes: int):
        """SGLang's StorageMetrics for the window since the last report (which starts a new one)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            w, self._window = self._window, Window()
        metrics = StorageMetrics()
        metrics.prefetch_pgs.append(w.prefetch_pages)
        metrics.backup_pgs.append(w.backup_pages)
        gib = page_bytes / 2**30
        metrics.prefetch_bandwidth.append(w.prefetch_pages * gib / w.prefetch_seconds if w.prefetch_seconds else 0)
        metrics.backup_bandwidth.append(w.backup_pages * gib / w.backup_seconds if w.backup_seconds else 0)
        return metrics
