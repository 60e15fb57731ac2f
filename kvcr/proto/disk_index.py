"""DiskIndex: which pages the NVMe tier holds, their sizes, digests and eviction order. Pure.

The driver (kvcr/drivers/nvme.py) does the file I/O and tells this index what happened; the index
decides what is visible, what to evict and which DISK events to publish.

    absent --reserve--> WRITING --commit (we published the file)--> PRESENT --evict/remove--> absent
                          |--abort / lost the race to another writer--> absent

Eviction is prefix-aware: only a page no present page continues (a leaf) is evicted, so a parent
outlives its children and whatever stays is reachable from a root. Inventories list roots first.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from .announce import Announce
from .events import BlockRemoved, BlockStored, Event
from .pool import coalesce_announces

MEDIUM_DISK = "DISK"


class DiskFull(Exception):
    """nvme.max_size has no room for a page that evicting other pages could make."""


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
        self._writing: dict[str, tuple[int, int | None]] = {}  # name -> (size, event hash)
        self._writing_hashes: Counter[int] = Counter()
        self._by_event_hash: dict[int, str] = {}
        self._children: Counter[int] = Counter()  # parent event hash -> present pages continuing it
        self._dropped: list[str] = []  # names gone since take_dropped (their DRAM copies lose their keeper)
        self._events: list[Event] = []
        self.num_bytes = 0
        self.num_evicted = 0
        self.num_corrupt = 0
        self.num_unverified = 0
        self.num_refused_full = 0

    # --- queries -----------------------------------------------------------------------------

    def get(self, name: str) -> DiskEntry | None:
        return self._entries.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def name_for_event_hash(self, event_hash: int) -> str | None:
        return self._by_event_hash.get(event_hash)

    def entries(self) -> list[DiskEntry]:
        return list(self._entries.values())

    def entries_root_first(self) -> list[DiskEntry]:
        return root_first(self._entries.values())

    def statistics(self) -> DiskStats:
        return DiskStats(len(self._entries), self.num_bytes, len(self._writing), self._bytes_writing(),
                         self.num_evicted, self.num_corrupt, self.num_unverified, self.max_bytes)

    # --- writes ------------------------------------------------------------------------------

    def reserve(self, name: str, size: int, announce: Announce | None = None) -> list[DiskEntry] | None:
        """Admit a write; returns the entries to evict first (possibly none), or None if the key is
        present or already being written (nothing to do). Raises DiskFull when max_bytes cannot
        hold the page without evicting one of its own ancestors (a parent outlives its children),
        or when the page continues nothing on disk (an orphan takes free room only)."""
        if name in self._entries or name in self._writing:
            return None
        parent = announce.parent_hash if announce is not None else None
        victims: list[DiskEntry] = []
        if self.max_bytes:
            used = self.num_bytes + self._bytes_writing() + size
            if used > self._high:
                orphan = parent is not None and parent not in self._by_event_hash \
                    and parent not in self._writing_hashes
                if not orphan:
                    victims = self._pick(used - self._low, protect=self._lineage(parent))
                if used - sum(v.size for v in victims) > self.max_bytes:
                    self.num_refused_full += 1
                    raise DiskFull(f"nvme.max_size = {self.max_bytes} bytes is taken by this page's ancestors and "
                                   "pages being written" if not orphan else "nvme.max_size is reached and the page "
                                   "continues no page on disk")
                self._evict(victims)
        event_hash = announce.event_hash if announce is not None else None
        self._writing[name] = (size, event_hash)
        if event_hash is not None:
            self._writing_hashes[event_hash] += 1
        return victims

    def _bytes_writing(self) -> int:
        return sum(size for size, _ in self._writing.values())

    def _end_writing(self, name: str) -> None:
        _, event_hash = self._writing.pop(name, (0, None))
        if event_hash is not None:
            self._writing_hashes[event_hash] -= 1
            if self._writing_hashes[event_hash] <= 0:
                del self._writing_hashes[event_hash]

    def _lineage(self, parent_hash: int | None) -> set[str]:
        """Names of the present pages a new page with this parent continues."""
        names: set[str] = set()
        while parent_hash is not None and (name := self._by_event_hash.get(parent_hash)) is not None \
                and name not in names:
            names.add(name)
            announce = self._entries[name].announce
            parent_hash = announce.parent_hash if announce is not None else None
        return names

    def commit(self, name: str, entry: DiskEntry) -> None:
        """The file is published under `name` (by us): make it visible and announce it."""
        self._end_writing(name)
        self._add(entry, announce=True)

    def commit_batch(self, entries: Sequence[DiskEntry]) -> None:
        """Commit published pages (chain order) and rank them as one use: each chain's tail is
        evicted before its head. Announced as one BlockStored per run of the batch."""
        for entry in entries:
            self._end_writing(entry.name)
            self._add(entry, announce=False)
        self._events.extend(coalesce_announces([e.announce for e in entries if e.announce is not None],
                                               self.block_size, MEDIUM_DISK))
        self.touch([e.name for e in entries])

    def abort(self, name: str) -> None:
        self._end_writing(name)

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
        if old is not None:  # replaced (adopted meanwhile): count its bytes and its parent link once
            self.num_bytes -= old.size
            self._count_child(old, -1)
        self._count_child(entry, +1)
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
        used = self.num_bytes + self._bytes_writing()
        return self._evict(self._pick(used - self._low)) if self.max_bytes and used > self._high else []

    def evict_bytes(self, nbytes: int) -> list[DiskEntry]:
        """Evict at least `nbytes` (a free-space floor was hit)."""
        return self._evict(self._pick(nbytes))

    def _evict(self, victims: list[DiskEntry]) -> list[DiskEntry]:
        self._drop(victims)
        self.num_evicted += len(victims)
        return victims

    def _pick(self, nbytes: int, protect: set[str] = frozenset()) -> list[DiskEntry]:
        """Up to `nbytes` worth of victims, least recently used leaves first (see the module
        docstring), none in `protect`."""
        victims: list[DiskEntry] = []
        freed, taken, released = 0, set(), Counter()
        while freed < nbytes:
            before = len(victims)
            for entry in self._entries.values():
                if freed >= nbytes:
                    break
                if entry.name in taken or entry.name in protect or self._continued(entry, released):
                    continue
                victims.append(entry)
                taken.add(entry.name)
                freed += entry.size
                if entry.announce is not None and entry.announce.parent_hash is not None:
                    released[entry.announce.parent_hash] += 1  # its parent may be a leaf now
            if len(victims) == before:
                break  # what remains is protected, or continued by protected pages
        return victims

    def _count_child(self, entry: DiskEntry, delta: int) -> None:
        parent = entry.announce.parent_hash if entry.announce is not None else None
        if parent is not None:
            self._children[parent] += delta
            if self._children[parent] <= 0:
                del self._children[parent]

    def _continued(self, entry: DiskEntry, released: Counter[int]) -> bool:
        if entry.announce is None:
            return False
        h = entry.announce.event_hash
        return self._children[h] - released[h] > 0

    def _drop(self, entries: list[DiskEntry]) -> None:
        hashes = []
        for entry in entries:
            del self._entries[entry.name]
            self._dropped.append(entry.name)
            self.num_bytes -= entry.size
            self._count_child(entry, -1)
            if entry.announce is not None:
                if self._by_event_hash.get(entry.announce.event_hash) == entry.name:
                    del self._by_event_hash[entry.announce.event_hash]
                hashes.extend(entry.announce.block_hashes)
        if hashes:
            self._events.append(BlockRemoved(block_hashes=tuple(hashes), medium=MEDIUM_DISK))

    def inventory(self) -> list[BlockStored]:
        return coalesce_announces([e.announce for e in self.entries_root_first() if e.announce is not None],
                                  self.block_size, MEDIUM_DISK)

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def take_dropped(self) -> list[str]:
        names, self._dropped = self._dropped, []
        return names


def root_first(entries: Iterable[DiskEntry]) -> list[DiskEntry]:
    """`entries` ordered so that every page comes after the page it continues (when present), each
    chain root first and contiguous where it can be (so announces coalesce into runs)."""
    entries = list(entries)
    by_hash = {e.announce.event_hash: e for e in entries if e.announce is not None}
    out: list[DiskEntry] = []
    placed: set[str] = set()
    for entry in entries:
        lineage = []
        node: DiskEntry | None = entry
        while node is not None and node.name not in placed:
            lineage.append(node)
            placed.add(node.name)
            parent = node.announce.parent_hash if node.announce is not None else None
            node = by_hash.get(parent) if parent is not None else None
        out.extend(reversed(lineage))
    return out
