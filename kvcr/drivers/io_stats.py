"""Counters the NVMe tier's I/O threads fill and a scrape reads, and a warning that says a failing
disk's story once per interval instead of once per page."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("kvcr.drivers.nvme")


class ThrottledWarning:
    """A warning logged at most once per `interval_s` per kind; the next one says how many were
    held back (a failing disk fails every page: the log should say so once, not per page)."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def warn(self, kind: str, msg: str, *args: object) -> None:
        with self._lock:
            now = self.clock()
            if now - self._last.get(kind, -math.inf) < self.interval_s:
                self._held[kind] += 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        log.warning(msg + (f" ({held} more like it since the last report)" if held else ""), *args)


@dataclass
class LatencyHistogram:
    """Fixed buckets (seconds), filled by the I/O threads and read at scrape time."""

    bounds: tuple[float, ...] = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)
    counts: list[int] = field(default_factory=lambda: [0] * 10)
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if seconds <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += seconds
