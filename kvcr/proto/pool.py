"""PagePool: slots, residency and eviction order of one named pool. Pure: no memory, no I/O.

Everything that changes a page's residency lives here, and records the inventory event on the
same line that changes the index. The owner drains events with `take_events()`.

    FREE --begin_fill--> FILLING --commit ok--> READY --evict/remove--> FREE
                            |--commit failed/abort--> FREE        |--remove while claimed--> DISCARDING
                                                             DISCARDING --last unpin--> FREE
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain, islice
from typing import Iterable, Sequence

from .announce import Announce
from .events import BlockRemoved, BlockStored, Event


class PoolError(Exception):
    """A request this pool cannot satisfy (raised to the caller, never swallowed)."""


class PoolExhausted(PoolError):
    pass


class PageSizeError(PoolError):
    pass


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
    __slots__ = ("key", "slot", "state", "generation", "num_claims", "announce", "digest")

    def __init__(self, key: str, slot: int, generation: int, announce: Announce | None) -> None:
        self.key = key
        self.slot = slot
        self.state = State.FILLING
        self.generation = generation
        self.num_claims = 0
        self.announce = announce
        self.digest: int | None = None  # xxh3-64 of the bytes at commit, when the runner keeps digests


@dataclass(frozen=True, slots=True)
class PoolStats:
    name: str
    capacity: int
    num_free: int
    num_filling: int
    num_ready: int
    num_discarding: int
    num_claimed: int
    page_bytes: int
    num_quarantined: int = 0


class PagePool:
    def __init__(self, name: str, *, page_bytes: int, num_slots: int, block_size: int,
                 medium: str = "CPU_PINNED", high_watermark: float = 1.0, low_watermark: float = 1.0) -> None:
        if num_slots < 1:
            raise PoolError(f"pool {name!r} has no room for a single {page_bytes}-byte page")
        if not 0 < low_watermark <= high_watermark <= 1.0:
            raise PoolError(f"pool {name!r}: need 0 < low_watermark <= high_watermark <= 1")
        self.name = name
        self.page_bytes = page_bytes
        self.capacity = num_slots
        self.block_size = block_size
        self.medium = medium
        self._high = max(1, int(num_slots * high_watermark))
        self._low = max(0, int(num_slots * low_watermark))
        self._free = list(range(num_slots - 1, -1, -1))
        self._generation = [0] * num_slots
        self._pages: dict[str, Page] = {}
        self._discarding: dict[int, Page] = {}
        self._quarantined: list[int] = []  # slots a cancelled transfer may still write: never reused
        self._lru: OrderedDict[str, None] = OrderedDict()  # READY and unclaimed, oldest first
        self._by_event_hash: dict[int, str] = {}
        self._events: list[Event] = []
        self.num_filling = 0
        self.num_ready = 0
        self.num_claimed = 0
        self.num_evicted = 0

    # --- queries -------------------------------------------------------------------------

    def get(self, key: str) -> Page | None:
        """The READY page for `key`, or None; FILLING and DISCARDING pages are invisible."""
        page = self._pages.get(key)
        return page if page is not None and page.state is State.READY else None

    def leading_ready(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            if self.get(key) is None:
                break
            n += 1
        return n

    def key_for_event_hash(self, event_hash: int) -> str | None:
        key = self._by_event_hash.get(event_hash)
        return key if key is not None and self.get(key) is not None else None

    def lru_keys(self, n: int) -> list[str]:
        """The `n` least recently used unclaimed READY keys (eviction candidates), oldest first."""
        return list(islice(self._lru, n))

    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def ready_pages(self) -> list[Page]:
        return [p for p in self._pages.values() if p.state is State.READY]

    def statistics(self) -> PoolStats:
        return PoolStats(self.name, self.capacity, len(self._free), self.num_filling, self.num_ready,
                         len(self._discarding), self.num_claimed, self.page_bytes, len(self._quarantined))

    # --- filling ---------------------------------------------------------------------------

    def begin_fill(self, keys: Sequence[str], announces: Sequence[Announce | None] | None = None
                   ) -> list[Page | InFlight | None]:
        """Reserve a slot per new key; all or nothing. Per key: the new FILLING page, None if the
        page is READY already, IN_FLIGHT if another fill is writing it (it may still fail).

        Raises PoolExhausted, naming the pool, when even eviction cannot make room.
        """
        if announces is not None:
            if len(announces) != len(keys):
                raise PageSizeError(f"pool {self.name!r}: {len(keys)} keys but {len(announces)} announces")
            self._check_announces(announces)
        wanted = dict.fromkeys(keys)
        new = [k for k in wanted if k not in self._pages]
        shortfall = len(new) - len(self._free)
        if shortfall > 0:
            if self._num_evictable(shortfall, protect=wanted) < shortfall:  # all or nothing: check first
                raise PoolExhausted(f"pool {self.name!r} is full: {len(new)} pages needed, {len(self._free)} free, "
                                    f"{self.num_claimed} claimed, {self.num_filling} filling")
            self._evict(shortfall, protect=wanted)
        position = {k: i for i, k in enumerate(keys)}
        made: dict[str, Page | InFlight] = {k: IN_FLIGHT for k in wanted if k in self._pages
                                            and self._pages[k].state is State.FILLING}
        for key in new:
            slot = self._free.pop()
            self._generation[slot] += 1
            announce = announces[position[key]] if announces else None
            made[key] = self._pages[key] = Page(key, slot, self._generation[slot], announce)
        self.num_filling += len(new)
        return [made.pop(k, None) for k in keys]

    def quarantine_fill(self, pages: Sequence[Page | InFlight | None]) -> int:
        """Give up FILLING pages whose slots may still be written by a transfer we could not stop:
        their keys become free again, their slots are never handed out again."""
        n = 0
        for page in pages:
            if not isinstance(page, Page):
                continue
            assert page.state is State.FILLING, f"quarantine of page {page.key} in state {page.state}"
            self.num_filling -= 1
            if self._pages.get(page.key) is page:
                del self._pages[page.key]
            self._quarantined.append(page.slot)
            n += 1
        return n

    def _check_announces(self, announces: Sequence[Announce | None]) -> None:
        for a in announces:
            if a is not None and len(a.token_ids) != self.block_size * len(a.block_hashes):
                raise PageSizeError(f"pool {self.name!r}: a page announces {len(a.token_ids)} token ids for "
                                    f"{len(a.block_hashes)} block(s), block_size is {self.block_size}")

    def commit_fill(self, pages: Sequence[Page | InFlight | None], ok: Sequence[bool] | None = None) -> int:
        """Publish filled pages (READY + BlockStored) and free failed ones. Returns pages committed."""
        if ok is not None and (len(ok) != len(pages) or not all(isinstance(x, bool) for x in ok)):
            raise PageSizeError(f"pool {self.name!r}: commit needs one bool per page ({len(pages)}), got {ok!r}")
        committed: list[Page] = []
        for i, page in enumerate(pages):
            if not isinstance(page, Page):
                continue
            assert page.state is State.FILLING, f"commit of page {page.key} in state {page.state}"
            self.num_filling -= 1
            if self._pages.get(page.key) is not page:  # cleared while filling
                self._free_slot(page.slot)
                continue
            if ok is not None and not ok[i]:
                del self._pages[page.key]
                self._free_slot(page.slot)
                continue
            page.state = State.READY
            self.num_ready += 1
            committed.append(page)
            if page.announce is not None:
                self._by_event_hash[page.announce.event_hash] = page.key
        self._touch_chain(committed)
        self._events.extend(coalesce_stored(committed, self.block_size, self.medium))
        self._evict_to_watermark()
        return len(committed)

    # --- reading and pinning ------------------------------------------------------------------

    def touch(self, keys: Sequence[str]) -> None:
        """Mark a chain as used: the head becomes most recent, the tail stays older."""
        self._touch_chain([p for p in (self._pages.get(k) for k in keys) if p is not None and p.num_claims == 0
                           and p.state is State.READY])

    def _touch_chain(self, pages: Sequence[Page]) -> None:
        lru = self._lru
        for page in reversed(pages):
            if page.num_claims == 0:
                lru[page.key] = None
                lru.move_to_end(page.key)

    def pin_prefix(self, keys: Sequence[str], limit: int) -> list[Page]:
        """Pin the leading READY pages (at most `limit`) against eviction."""
        pinned = []
        for key in keys[:limit]:
            page = self.get(key)
            if page is None:
                break
            if page.num_claims == 0:
                self._lru.pop(key, None)
                self.num_claimed += 1
            page.num_claims += 1
            pinned.append(page)
        return pinned

    def pin_pages(self, pages: Iterable[Page]) -> None:
        """One more pin on pages that are pinned already (whatever their state since)."""
        for page in pages:
            assert page.num_claims > 0, f"pin_pages on unpinned page {page.key}"
            page.num_claims += 1

    def unpin(self, pages: Iterable[Page]) -> None:
        released = []
        for page in pages:
            assert page.num_claims > 0, f"unpin of unclaimed page {page.key}"
            page.num_claims -= 1
            if page.num_claims:
                continue
            self.num_claimed -= 1
            if page.state is State.DISCARDING:
                del self._discarding[page.slot]
                self._free_slot(page.slot)
            else:
                released.append(page)
        self._touch_chain(released)

    def is_live(self, page: Page) -> bool:
        """True while the slot still holds this page's bytes (same generation, not freed)."""
        return page.state is not State.FILLING and self._generation[page.slot] == page.generation \
            and (self._pages.get(page.key) is page or self._discarding.get(page.slot) is page)

    # --- removal -------------------------------------------------------------------------------

    def remove(self, keys: Iterable[str]) -> int:
        """Drop READY pages (a claimed one stays readable until released). Returns pages removed."""
        gone = [p for p in (self._pages.get(k) for k in keys) if p is not None and p.state is State.READY]
        for page in gone:
            self._drop(page)
        self._record_removed(gone)
        return len(gone)

    def clear(self) -> int:
        """Remove every page; FILLING pages are freed when their fill commits."""
        ready = [p for p in self._pages.values() if p.state is State.READY]
        for page in ready:
            self._drop(page)
        self._pages.clear()  # FILLING pages now fail the identity check in commit_fill
        self._record_removed(ready)
        return len(ready)

    def _drop(self, page: Page) -> None:
        self.num_ready -= 1
        self._pages.pop(page.key, None)
        self._lru.pop(page.key, None)
        if page.announce is not None and self._by_event_hash.get(page.announce.event_hash) == page.key:
            del self._by_event_hash[page.announce.event_hash]
        if page.num_claims:
            page.state = State.DISCARDING
            self._discarding[page.slot] = page
        else:
            self._free_slot(page.slot)

    def _free_slot(self, slot: int) -> None:
        self._generation[slot] += 1
        self._free.append(slot)

    def _num_evictable(self, n: int, protect: dict | set) -> int:
        """How many of the oldest unclaimed READY pages outside `protect` exist, counting up to n."""
        found = 0
        for key in self._lru:
            if found >= n:
                break
            found += key not in protect
        return found

    def _evict(self, n: int, protect: dict | set = frozenset()) -> int:
        """Evict up to n unclaimed READY pages, oldest first, never one in `protect`."""
        victims, spared = [], []
        while len(victims) < n and self._lru:
            key, _ = self._lru.popitem(last=False)
            (spared if key in protect else victims).append(key)
        for key in reversed(spared):
            self._lru[key] = None
            self._lru.move_to_end(key, last=False)
        pages = [self._pages[k] for k in victims]
        for page in pages:
            self._drop(page)
        self.num_evicted += len(pages)
        self._record_removed(pages)
        return len(pages)

    def _evict_to_watermark(self) -> None:
        used = self.capacity - len(self._free)
        if used > self._high:
            self._evict(used - self._low)

    def _record_removed(self, pages: Sequence[Page]) -> None:
        hashes = tuple(h for p in pages if p.announce is not None for h in p.announce.block_hashes)
        if hashes:
            self._events.append(BlockRemoved(block_hashes=hashes, medium=self.medium))

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def coalesce_stored(pages: Sequence[Page], block_size: int, medium: str) -> list[BlockStored]:
    return coalesce_announces([p.announce for p in pages if p.announce is not None], block_size, medium)


def coalesce_announces(announces: Sequence[Announce], block_size: int, medium: str) -> list[BlockStored]:
    """One BlockStored per run of pages that continue each other's chain (as SGLang does)."""
    out: list[BlockStored] = []
    run: list[Announce] = []
    seen: set[int] = set()

    def flush() -> None:
        if run:
            out.append(BlockStored(block_hashes=tuple(h for a in run for h in a.block_hashes),
                                   parent_block_hash=run[0].parent_hash,
                                   token_ids=tuple(chain.from_iterable(a.token_ids for a in run)),
                                   block_size=block_size, medium=medium, lora_name=run[0].lora_name,
                                   cache_salt=run[0].cache_salt))
            run.clear()
            seen.clear()

    for a in announces:
        if run and not (a.parent_hash == run[-1].event_hash and a.lora_name == run[0].lora_name
                        and a.cache_salt == run[0].cache_salt and a.event_hash not in seen):
            flush()
        run.append(a)
        seen.add(a.event_hash)
    flush()
    return out
