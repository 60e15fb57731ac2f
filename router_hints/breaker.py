"""Which workers a router takes out of routing because requests to them fail. Pure.

Liveness (`liveness.py`) watches a worker's event stream; this watches what its HTTP server does
with requests. A refused connection (nothing listens: the engine is gone or restarting) opens a
worker's breaker at once; other failures before the first byte (a reset, a timeout, a 502/503/504)
open it after `failures_to_open` in a row. An open worker gets no requests and is no hint source
until its health check passes; a success closes the count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .index import Worker


@dataclass
class Breakers:
    failures_to_open: int = 3
    _failures: dict[Worker, int] = field(default_factory=dict)  # failures in a row, while closed
    _open: set[Worker] = field(default_factory=set)
    num_opened: int = 0

    def __post_init__(self) -> None:
        assert self.failures_to_open >= 1, f"failures_to_open {self.failures_to_open} must be >= 1"

    def failed(self, worker: Worker, *, refused: bool) -> bool:
        """A request to `worker` failed before its first byte; True when this opened its breaker."""
        if worker in self._open:
            return False
        count = self._failures.get(worker, 0) + 1
        if refused or count >= self.failures_to_open:
            self._failures.pop(worker, None)
            self._open.add(worker)
            self.num_opened += 1
            return True
        self._failures[worker] = count
        return False

    def succeeded(self, worker: Worker) -> None:
        self._failures.pop(worker, None)

    def health_passed(self, worker: Worker) -> bool:
        """Its health check passed: routed to again. True when it was open."""
        self._failures.pop(worker, None)
        if worker not in self._open:
            return False
        self._open.discard(worker)
        return True

    def forget(self, worker: Worker) -> None:
        self._failures.pop(worker, None)
        self._open.discard(worker)

    def is_open(self, worker: Worker) -> bool:
        return worker in self._open

    @property
    def open(self) -> frozenset[Worker]:
        return frozenset(self._open)
