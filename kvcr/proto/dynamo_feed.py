"""What Dynamo's router must be told so its view of one runner stays right. Pure: `now` is passed in.

Dynamo's `KvEventPublisher` relays a ZMQ stream into its event plane but takes no replay
endpoint and ignores seq gaps, and Dynamo counts stores per (worker, tier). So the feed never
lets Dynamo guess: it starts every view with `AllBlocksCleared` plus the runner's snapshot, and
clears the view whenever it can no longer vouch for it (the runner restarted, a gap could not be
replayed, or the runner went silent), resyncing from a fresh snapshot once the runner is back.
A stale view costs a hint that names pages nobody holds; a cleared one costs only a miss.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from .events import AllBlocksCleared, BlockRemoved, BlockStored, Event

CLEAR: tuple[Event, ...] = (AllBlocksCleared(),)


class Phase(enum.Enum):
    WAITING = "waiting"      # no relay subscribed yet: anything published now would be lost
    SYNCING = "syncing"      # the view is cleared; the next snapshot makes it whole
    LIVE = "live"            # Dynamo holds the snapshot plus every batch since
    DEAD = "dead"            # the runner is silent: Dynamo was told it holds nothing


@dataclass
class DynamoFeed:
    dead_after_s: float
    phase: Phase = Phase.WAITING
    last_heard: float = 0.0
    # (medium, hash) -> stores Dynamo counts for it (its reference counting, mirrored).
    told: Counter = field(default_factory=Counter)
    num_resyncs: int = 0
    num_clears: int = 0
    last_problem: str = ""

    @property
    def wants_snapshot(self) -> bool:
        return self.phase is Phase.SYNCING

    def subscribed(self, now: float) -> tuple[Event, ...]:
        """A relay subscribed (first time, or again after its socket reconnected): start over."""
        return self._clear(now, "relay subscribed")

    def snapshot(self, events: Iterable[Event], now: float) -> tuple[Event, ...]:
        """The runner's inventory, as of the batch the subscriber now continues after."""
        if self.phase is not Phase.SYNCING:
            return ()
        body = tuple(events)
        self.told.clear()
        self._count(body)
        self.phase = Phase.LIVE
        self.last_heard = now
        self.num_resyncs += 1
        return CLEAR + body

    def batch(self, events: tuple[Event, ...], now: float) -> tuple[Event, ...]:
        """A live or replayed batch in order; heartbeats (no events) only prove the runner is up."""
        self.last_heard = now
        if self.phase is Phase.DEAD:
            self.phase = Phase.SYNCING  # back: what it holds now is in its snapshot
            return ()
        if self.phase is not Phase.LIVE:
            return ()  # the coming snapshot covers it
        self._count(events)
        return events

    def lost(self, now: float, why: str) -> tuple[Event, ...]:
        """The runner restarted or a gap could not be replayed: the view can no longer be vouched for."""
        if self.phase is Phase.WAITING:
            return ()
        return self._clear(now, why)

    def tick(self, now: float) -> tuple[Event, ...]:
        if self.phase is Phase.LIVE and self.dead_after_s > 0 and now - self.last_heard >= self.dead_after_s:
            events = self._clear(now, f"runner silent for {now - self.last_heard:.1f} s")
            self.phase = Phase.DEAD
            return events
        return ()

    def blocks(self, medium: str | None) -> int:
        return sum(1 for (m, _h), n in self.told.items() if m == medium and n > 0)

    def _clear(self, now: float, why: str) -> tuple[Event, ...]:
        self.told.clear()
        self.phase = Phase.SYNCING
        self.last_heard = now
        self.num_clears += 1
        self.last_problem = why
        return CLEAR

    def _count(self, events: Iterable[Event]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.told.clear()
            elif isinstance(event, BlockStored):
                self.told.update((event.medium, h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    key = (event.medium, h)
                    if self.told[key] > 1:
                        self.told[key] -= 1
                    else:
                        self.told.pop(key, None)
