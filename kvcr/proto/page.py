"""A page of a pool and the states it moves through (kvcr/proto/pool.py moves it)."""

from __future__ import annotations

import enum

from .announce import Announce
from .keys import StorageKey


class Keep(enum.Enum):
    """Whether the tier below holds a READY page; for the pages it does not, why (the drop reason)."""

    NONE = "no_lower_tier"
    DIRTY = "nvme_lagging"          # queued for the tier below, not written yet
    CLEAN = "kept"                  # the tier below holds it: eviction loses nothing
    WRITE_FAILED = "nvme_write_failed"
    LOWER_FULL = "nvme_full"        # the tier below had room only for this page's ancestors
    LOWER_EVICTED = "nvme_evicted"  # the tier below let its copy go


class State(enum.Enum):
    FILLING = "filling"
    READY = "ready"
    DISCARDING = "discarding"


class InFlight:
    """Sentinel from begin_fill: another fill is writing this key right now."""

    def __repr__(self) -> str:
        return "IN_FLIGHT"


IN_FLIGHT = InFlight()


class Page:
    __slots__ = ("key", "slot", "state", "generation", "num_claims", "announce", "digest", "keep")

    def __init__(self, key: StorageKey, slot: int, generation: int, announce: Announce | None) -> None:
        self.keep = Keep.NONE
        self.key = key
        self.slot = slot
        self.state = State.FILLING
        self.generation = generation
        self.num_claims = 0
        self.announce = announce
        self.digest: int | None = None  # xxh3-64 of the bytes at commit, when the runner keeps digests
