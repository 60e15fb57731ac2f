"""DiskIndex: which pages the NVMe tier holds, their sizes, digests and eviction order. Pure.

The driver (kvcr/drivers/nvme.py) does the file I/O and tells this index what happened; the index
decides what is visible, what to evict and which DISK events to publish.

    absent --reserve--> WRITING --commit (we published the file)--> PRESENT --evict/remove--> absent
                          |--abort / lost the race to another writer--> absent
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .announce import Announce
from .events import BlockRemoved, BlockStored, Event
from .pool import coalesce_announces

MEDIUM_DISK = "DISK"


@dataclass(slots=True)
class DiskEntry:
    name: str                 # file stem: page hash + HiCacheFile suffix
    size: int
    digest: int | None        # None: written by another program (HiCacheFile), checked on size only
    announce: Announce | None
    # (inode, mtime_ns) of the file once its bytes matched the digest. Page files are immutable
    # (a new version is a new file), so an unchanged inode and mtime need no second check.
    verified: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class DiskStats:
    num_pages: int
    num_bytes: int
    num_writing: int
    bytes_reserved: int
    num_evicted: int
    num_corrupt: int
    num_unverified: int
    max_bytes: int


class DiskIndex:
    def __init__(self, *, block_size: int, max_bytes: int = 0, high_watermark: float = 1.0,
                 low_watermark: float = 0.9) -> None:
        self.block_size = block_size
        self.max_bytes = max_bytes  # 0: unbounded (the filesystem's free-space floor still applies)
        self._high = int(max_bytes * high_watermark)
        self._low = int(max_bytes * low_watermark)
        self._entries: OrderedDict[str, DiskEntry] = OrderedDict()  # oldest first
        self._writing: dict[str, int] = {}
        self._by_event_hash: dict[int, str] = {}
        self._events: list[Event] = []
        self.num_bytes = 0
        self.num_evicted = 0
        self.num_corrupt = 0
        self.num_unverified = 0

    # --- queries -----------------------------------------------------------------------------

    def get(self, name: str) -> DiskEntry | None:
        return self._entries.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def name_for_event_hash(self, event_hash: int) -> str | None:
        return self._by_event_hash.get(event_hash)

    def entries(self) -> list[DiskEntry]:
        return list(self._entries.values())

    def statistics(self) -> DiskStats:
        return DiskStats(len(self._entries), self.num_bytes, len(self._writing), sum(self._writing.values()),
                         self.num_evicted, self.num_corrupt, self.num_unverified, self.max_bytes)

    # --- writes ------------------------------------------------------------------------------

    def reserve(self, name: str, size: int) -> list[DiskEntry] | None:
        """Admit a write; returns the entries to evict first (possibly none), or None if the key is
        present or already being written (nothing to do)."""
        if name in self._entries or name in self._writing:
            return None
        self._writing[name] = size
        victims = []
        if self.max_bytes:
            used = self.num_bytes + sum(self._writing.values())
            if used > self._high:
                victims = self._take_oldest(used - self._low)
        return victims

    def commit(self, name: str, entry: DiskEntry) -> None:
        """The file is published under `name` (by us): make it visible and announce it."""
        self._writing.pop(name, None)
        self._add(entry, announce=True)

    def abort(self, name: str) -> None:
        self._writing.pop(name, None)

    def adopt(self, entry: DiskEntry, *, announce: bool = True) -> bool:
        """A page found on disk (startup scan, or written by another process). False if known or
        being written by us (our commit will add it)."""
        if entry.name in self._entries or entry.name in self._writing:
            return False
        if entry.digest is None:
            self.num_unverified += 1
        self._add(entry, announce=announce)
        return True

    def _add(self, entry: DiskEntry, *, announce: bool) -> None:
        old = self._entries.get(entry.name)
        if old is not None:  # replaced (adopted meanwhile): count its bytes once
            self.num_bytes -= old.size
        self._entries[entry.name] = entry
        self.num_bytes += entry.size
        if entry.announce is not None:
            self._by_event_hash[entry.announce.event_hash] = entry.name
            if announce:
                self._events.extend(coalesce_announces([entry.announce], self.block_size, MEDIUM_DISK))

    # --- reads and removal ---------------------------------------------------------------------

    def touch(self, names: list[str]) -> None:
        """Mark a chain as used, head most recent (its tail is evicted first)."""
        for name in reversed(names):
            if name in self._entries:
                self._entries.move_to_end(name)

    def remove(self, names: list[str], *, corrupt: bool = False) -> list[DiskEntry]:
        gone = [self._entries[n] for n in names if n in self._entries]
        self._drop(gone)
        if corrupt:
            self.num_corrupt += len(gone)
        return gone

    def clear(self) -> list[DiskEntry]:
        gone = list(self._entries.values())
        self._drop(gone)
        return gone

    def evict_to_watermark(self) -> list[DiskEntry]:
        used = self.num_bytes + sum(self._writing.values())
        return self._take_oldest(used - self._low) if self.max_bytes and used > self._high else []

    def evict_bytes(self, nbytes: int) -> list[DiskEntry]:
        """Evict at least `nbytes` (a free-space floor was hit)."""
        return self._take_oldest(nbytes)

    def _take_oldest(self, nbytes: int) -> list[DiskEntry]:
        victims, freed = [], 0
        for entry in self._entries.values():
            if freed >= nbytes:
                break
            victims.append(entry)
            freed += entry.size
        self._drop(victims)
        self.num_evicted += len(victims)
        return victims

    def _drop(self, entries: list[DiskEntry]) -> None:
        hashes = []
        for entry in entries:
            del self._entries[entry.name]
            self.num_bytes -= entry.size
            if entry.announce is not None:
                if self._by_event_hash.get(entry.announce.event_hash) == entry.name:
                    del self._by_event_hash[entry.announce.event_hash]
                hashes.extend(entry.announce.block_hashes)
        if hashes:
            self._events.append(BlockRemoved(block_hashes=tuple(hashes), medium=MEDIUM_DISK))

    def inventory(self) -> list[BlockStored]:
        return coalesce_announces([e.announce for e in self._entries.values() if e.announce is not None],
                                  self.block_size, MEDIUM_DISK)

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events
