"""A runner's event stream: what its tiers changed, published in the order it changed, and the
whole inventory announced again when the stream starts over (a new incarnation, an engine relay's
resync). The caller holds the runner's lock where a method says so."""

from __future__ import annotations

import threading
from typing import Callable, Mapping, Sequence

from ..proto.events import AllBlocksCleared, Event
from ..proto.pool import PagePool, coalesce_stored
from ..proto.relay import RelayStep
from .lower import LowerTier


class EventStream:
    def __init__(self, pools: Mapping[str, PagePool], lower: LowerTier, publish: Callable[[Sequence[Event]], int],
                 lock: threading.RLock) -> None:
        self._pools = pools
        self._lower = lower
        self._publish = publish
        self._lock = lock
        # Told our own events before they go out; what it returns follows them in the same batch
        # (the engine relay shows engine blocks it held back until we stored them).
        self.follower: Callable[[Sequence[Event]], Sequence[Event]] | None = None

    def flush(self) -> None:
        """Publish what changed (under the lock)."""
        nvme = self._lower.take_events()  # first: it marks DRAM copies NVMe let go as unkept
        events = [e for pool in self._pools.values() for e in pool.take_events()] + nvme
        if events:
            self._publish(events + list(self.follower(events)) if self.follower is not None else events)

    def inventory(self) -> list[Event]:
        """The whole announced inventory as BlockStored events (under the lock)."""
        events: list[Event] = []
        for pool in self._pools.values():
            events.extend(coalesce_stored(pool.ready_pages(), pool.block_size, pool.medium))
        return events + self._lower.inventory()

    def relay(self, step: RelayStep) -> None:
        """Publish relayed engine events; a resync first clears and re-announces our own pages.

        Our pending events go out first, so the stream keeps the order in which state changed."""
        with self._lock:
            self.flush()
            if step.resync:
                self._publish([AllBlocksCleared(), *self.inventory(), *step.events])
            elif step.events:
                self._publish(step.events)

    def announce_start(self) -> None:
        """First batch of an incarnation: clear what routers believe, then re-announce what we hold."""
        with self._lock:
            self._publish([AllBlocksCleared(), *self.inventory()])
