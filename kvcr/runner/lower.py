"""The seam between the DRAM core and the tier below it, declared from both sides.

`LowerTier` is what the core (dram.py) calls; `NoLowerTier` is the tier of a runner without NVMe,
so the core never asks whether it has one. `DramSide` is what a lower tier may ask of the DRAM
above it: fills, pinning, slot bytes and the one lock the DRAM pools and the disk indexes share
(a page's DIRTY/CLEAN state is PagePool's, settled by the tier under that lock). Neither side
imports the other; the store (store.py) builds both and joins them.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, Sequence

from ..proto.announce import Announce
from ..proto.claims import Fill
from ..proto.disk_index import DiskStats
from ..proto.events import Event
from ..proto.keys import StorageKey
from ..proto.page import Page
from ..proto.pool import PagePool, PoolBusy


@dataclass(frozen=True, slots=True)
class DiskStatistics:
    """What one pool's NVMe tier counts besides its index: files, errors, latencies."""

    foreign: int                                       # files in the namespace that are not pages
    errors: tuple[tuple[str, int], ...]                # (errno name, count), sorted
    read_latency: tuple[tuple[float, ...], tuple[int, ...], float]   # bounds, counts, total seconds
    write_latency: tuple[tuple[float, ...], tuple[int, ...], float]


@dataclass(frozen=True, slots=True)
class TieringStatistics:
    spilled: int       # DRAM pages written to NVMe (write-behind or spill)
    skipped: int       # dirty pages already on NVMe: not rewritten
    refused: tuple[tuple[str, int], ...]               # (reason, pages) NVMe did not take, sorted
    promoted: int
    fill_waits: int
    fill_wait_s: float
    shutdown_flush: tuple[float, int, int] | None      # seconds, pages written, pages left
    disks: tuple[tuple[str, DiskStatistics], ...]      # per pool with an NVMe tier


class DramSide(Protocol):
    """What a lower tier may ask of the DRAM core above it."""

    lock: threading.RLock

    def pool(self, name: str) -> PagePool: ...
    def keys(self, pool: str, page_hexes: Sequence[str]) -> list[StorageKey]: ...
    def reserve(self, pool: str, keys: Sequence[StorageKey], announces: Sequence[Announce | None] | None = None, *,
                owner: str = "local", lease_s: float | None = None, writer_pid: int = 0) -> Fill: ...
    def commit(self, fill_id: int, ok: Sequence[bool] | None = None, *, owner: str = "local",
               clean: bool = False) -> int: ...
    def slot_view(self, pool: str, page: Page) -> memoryview: ...
    def pinned(self, pool: str, keys: Sequence[StorageKey]) -> AbstractContextManager[list[Page]]: ...
    def flush_events(self) -> None: ...
    def flush_events_locked(self) -> None: ...


class LowerTier(Protocol):
    """What the DRAM core asks of the tier below it. Calls marked (under the lock) are made with
    DramSide.lock held; the others take it themselves."""

    pools: frozenset[str]  # the pools this tier keeps pages for

    def wait_for_writer(self, pool: str, busy: PoolBusy, deadline: float | None) -> float: ...
    def waited(self, deadline: float) -> None: ...
    def committed(self) -> None: ...
    def on_disk(self, pool: str, keys: Sequence[StorageKey]) -> list[bool]: ...            # (under the lock)
    def holds_event_hash(self, event_hash: int) -> bool: ...                             # (under the lock)
    def complete_run(self, pool: str, keys: Sequence[StorageKey]) -> None: ...
    def persist(self, pool: str, keys: Sequence[StorageKey]) -> int: ...
    def take_events(self) -> list[Event]: ...                                              # (under the lock)
    def inventory(self) -> list[Event]: ...                                                # (under the lock)
    def page_hexes(self, pool: str) -> list[str]: ...                                      # (under the lock)
    def remove(self, pool: str, page_hexes: Sequence[str]) -> int: ...
    def evicted(self) -> dict[str, int]: ...                                               # (under the lock)
    def index_statistics(self, pool: str) -> DiskStats | None: ...                          # (under the lock)
    def statistics(self) -> TieringStatistics: ...                                         # (under the lock)
    def start_scans(self) -> list[threading.Thread]: ...
    def housekeeping(self) -> None: ...
    def healthy(self) -> bool: ...
    def flush(self) -> tuple[float, int, int]: ...
    def close(self) -> None: ...


class NoLowerTier:
    """The tier of a runner without NVMe: holds nothing, so every page DRAM lets go is dropped."""

    pools: frozenset[str] = frozenset()

    def wait_for_writer(self, pool: str, busy: PoolBusy, deadline: float | None) -> float:
        raise busy  # no writer to wait for: PagePool raises PoolBusy only for DIRTY pages, which need a tier

    def waited(self, deadline: float) -> None:
        pass

    def committed(self) -> None:
        pass

    def on_disk(self, pool: str, keys: Sequence[StorageKey]) -> list[bool]:
        return [False] * len(keys)

    def holds_event_hash(self, event_hash: int) -> bool:
        return False

    def complete_run(self, pool: str, keys: Sequence[StorageKey]) -> None:
        pass

    def persist(self, pool: str, keys: Sequence[StorageKey]) -> int:
        raise ValueError(f"pool {pool!r} has no NVMe tier")

    def take_events(self) -> list[Event]:
        return []

    def inventory(self) -> list[Event]:
        return []

    def page_hexes(self, pool: str) -> list[str]:
        return []

    def remove(self, pool: str, page_hexes: Sequence[str]) -> int:
        return 0

    def evicted(self) -> dict[str, int]:
        return {}

    def index_statistics(self, pool: str) -> DiskStats | None:
        return None

    def statistics(self) -> TieringStatistics:
        return TieringStatistics(0, 0, (), 0, 0, 0.0, None, ())

    def start_scans(self) -> list[threading.Thread]:
        return []

    def housekeeping(self) -> None:
        pass

    def healthy(self) -> bool:
        return True

    def flush(self) -> tuple[float, int, int]:
        return (0.0, 0, 0)

    def close(self) -> None:
        pass
