"""Which workers are alive, from their event streams. Pure: `now` is passed in.

A kvcr runner publishes at least a heartbeat batch every `events.heartbeat_s` (1 s by default),
so a stream silent for `dead_after_s` means the worker is gone (crashed, partitioned, paused)
whatever its sockets say: ZMQ reconnects quietly and never reports a closed peer. A dead worker
is no routing candidate and no hint source, and its blocks are dropped; its next batch revives it,
and the router then reloads its snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .index import Worker


@dataclass
class Liveness:
    dead_after_s: float  # 0: never declared dead
    _last: dict[Worker, float] = field(default_factory=dict)
    _dead: set[Worker] = field(default_factory=set)
    num_deaths: int = 0

    def watch(self, worker: Worker, now: float) -> None:
        """Start expecting batches from `worker` (a publisher that heartbeats)."""
        self._last[worker] = now
        self._dead.discard(worker)

    def forget(self, worker: Worker) -> None:
        self._last.pop(worker, None)
        self._dead.discard(worker)

    def heard(self, worker: Worker, now: float) -> bool:
        """A batch from `worker`; True when it was dead until now (revived)."""
        if worker not in self._last:
            return False
        self._last[worker] = now
        if worker in self._dead:
            self._dead.discard(worker)
            return True
        return False

    def expire(self, now: float) -> list[Worker]:
        """Workers silent for dead_after_s since they were last heard: newly dead."""
        if self.dead_after_s <= 0:
            return []
        gone = [w for w, t in self._last.items() if w not in self._dead and now - t >= self.dead_after_s]
        self._dead.update(gone)
        self.num_deaths += len(gone)
        return gone

    def is_dead(self, worker: Worker) -> bool:
        return worker in self._dead

    @property
    def dead(self) -> frozenset[Worker]:
        return frozenset(self._dead)
