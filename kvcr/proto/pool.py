"""PagePool: slots, residency and eviction order of one named pool. Pure: no memory, no I/O.

Everything that changes a page's residency lives here, and records the inventory event on the
same line that changes the index. The owner drains events with `take_events()`.

    FREE --begin_fill--> FILLING --commit ok--> READY --evict/remove--> FREE
                            |--commit failed/abort--> FREE        |--remove while claimed--> DISCARDING
                                                             DISCARDING --last unpin--> FREE

With a tier below (`lower=True`), a READY page is also DIRTY (queued for that tier) or CLEAN
(the tier holds it). Eviction takes clean pages first; a page it takes that the tier below does
not hold is dropped, counted under the reason in its `Keep`. See docs/nvme.md.

Its parts, each with one job: slots.py (free slots, generations, quarantine), write_queue.py (the
DIRTY pages), eviction.py (which pages go, in which order), recent_keys.py (what was held lately).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from itertools import chain, islice
from typing import Iterable, Sequence

from .announce import Announce
from .eviction import down_to_watermark, victims
from .events import MEDIUM_DRAM, BlockRemoved, BlockStored, Event
from .page import IN_FLIGHT, InFlight, Keep, Page, State
from .recent_keys import RecentKeys
from .slots import SlotTable
from .write_queue import WriteQueue

__all__ = ["IN_FLIGHT", "InFlight", "Keep", "Page", "PagePool", "PageSizeError", "PoolBusy", "PoolError",
           "PoolExhausted", "PoolStats", "State", "coalesce_announces", "coalesce_stored"]


class PoolError(Exception):
    """A request this pool cannot satisfy (raised to the caller, never swallowed)."""


class PoolExhausted(PoolError):
    pass


class PageSizeError(PoolError):
    pass


class PoolBusy(PoolExhausted):
    """Room exists only in DIRTY pages: it appears once the writer has saved them (or they are dropped)."""

    def __init__(self, message: str, shortfall: int) -> None:
        super().__init__(message)
        self.shortfall = shortfall


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
    num_dirty: int = 0


class PagePool:
    def __init__(self, name: str, *, page_bytes: int, num_slots: int, block_size: int,
                 medium: str = MEDIUM_DRAM, high_watermark: float = 1.0, low_watermark: float = 1.0,
                 lower: bool = False) -> None:
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
        self._slots = SlotTable(num_slots)
        self._pages: dict[str, Page] = {}
        self._discarding: dict[int, Page] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # READY and unclaimed, oldest first
        self.lower = lower
        self._writes = WriteQueue()  # with a tier below: the DIRTY pages
        self.dropped: Counter[str] = Counter()  # pages evicted that no tier below kept, by Keep reason
        self._by_event_hash: dict[int, str] = {}
        self._ever = RecentKeys(4 * num_slots)
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

    def num_used(self) -> int:
        return self._slots.num_used

    def ready_pages(self) -> list[Page]:
        return [p for p in self._pages.values() if p.state is State.READY]

    def statistics(self) -> PoolStats:
        return PoolStats(self.name, self.capacity, self._slots.num_free, self.num_filling, self.num_ready,
                         len(self._discarding), self.num_claimed, self.page_bytes, self._slots.num_quarantined,
                         self.num_dirty)

    @property
    def num_writing(self) -> int:
        return self._writes.num_writing

    @property
    def num_dirty(self) -> int:
        return len(self._writes)

    def oldest_dirty_since(self) -> float | None:
        """Commit time of the oldest page not yet in the tier below (write-behind lag)."""
        return self._writes.oldest_since()

    # --- filling ---------------------------------------------------------------------------

    def begin_fill(self, keys: Sequence[str], announces: Sequence[Announce | None] | None = None, *,
                   evict_dirty: bool = False) -> list[Page | InFlight | None]:
        """Reserve a slot per new key; all or nothing. Per key: the new FILLING page, None if the
        page is READY already, IN_FLIGHT if another fill is writing it (it may still fail).

        Raises PoolExhausted, naming the pool, when even eviction cannot make room, and PoolBusy
        when only DIRTY pages could make it and `evict_dirty` (drop them) is not set.
        """
        if announces is not None:
            if len(announces) != len(keys):
                raise PageSizeError(f"pool {self.name!r}: {len(keys)} keys but {len(announces)} announces")
            self._check_announces(announces)
        wanted = dict.fromkeys(keys)
        new = [k for k in wanted if k not in self._pages]
        shortfall = len(new) - self._slots.num_free
        if shortfall > 0:
            self._make_room(shortfall, wanted, len(new), evict_dirty)
        position = {k: i for i, k in enumerate(keys)}
        made: dict[str, Page | InFlight] = {k: IN_FLIGHT for k in wanted if k in self._pages
                                            and self._pages[k].state is State.FILLING}
        for key in new:
            slot, generation = self._slots.take()
            announce = announces[position[key]] if announces else None
            made[key] = self._pages[key] = Page(key, slot, generation, announce)
        self.num_filling += len(new)
        return [made.pop(k, None) for k in keys]

    def _make_room(self, shortfall: int, protect: dict, needed: int, evict_dirty: bool) -> None:
        """Evict `shortfall` pages or none (all or nothing: counted first)."""
        clean = self._num_evictable(shortfall, protect, dirty=False)
        if clean < shortfall:
            # Pages the writer holds come back (CLEAN) when its batch ends: worth waiting for too.
            waitable = self._num_evictable(shortfall, protect, dirty=True) + (0 if evict_dirty else self.num_writing)
            if waitable < shortfall:
                raise PoolExhausted(f"pool {self.name!r} is full: {needed} pages needed, {self._slots.num_free} free, "
                                    f"{self.num_claimed} claimed, {self.num_filling} filling")
            if not evict_dirty:
                raise PoolBusy(f"pool {self.name!r}: {shortfall - clean} more pages must be written to NVMe before "
                               f"they can be evicted ({self.num_dirty} dirty)", shortfall - clean)
        self._evict(shortfall, protect=protect, dirty=evict_dirty)

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
            self._slots.quarantine(page.slot)
            n += 1
        return n

    def _check_announces(self, announces: Sequence[Announce | None]) -> None:
        for a in announces:
            if a is not None and len(a.token_ids) != self.block_size * len(a.block_hashes):
                raise PageSizeError(f"pool {self.name!r}: a page announces {len(a.token_ids)} token ids for "
                                    f"{len(a.block_hashes)} block(s), block_size is {self.block_size}")

    def commit_fill(self, pages: Sequence[Page | InFlight | None], ok: Sequence[bool] | None = None, *,
                    now: float = 0.0, clean: bool = False) -> int:
        """Publish filled pages (READY + BlockStored) and free failed ones. Returns pages committed.
        With a tier below, committed pages are queued for it (DIRTY since `now`), unless `clean`
        (read from it)."""
        if ok is not None and (len(ok) != len(pages) or not all(isinstance(x, bool) for x in ok)):
            raise PageSizeError(f"pool {self.name!r}: commit needs one bool per page ({len(pages)}), got {ok!r}")
        committed: list[Page] = []
        for i, page in enumerate(pages):
            if not isinstance(page, Page):
                continue
            assert page.state is State.FILLING, f"commit of page {page.key} in state {page.state}"
            self.num_filling -= 1
            if self._pages.get(page.key) is not page:  # cleared while filling
                self._slots.free(page.slot)
                continue
            if ok is not None and not ok[i]:
                del self._pages[page.key]
                self._slots.free(page.slot)
                continue
            page.state = State.READY
            self.num_ready += 1
            committed.append(page)
            if self.lower and clean:
                page.keep = Keep.CLEAN
            elif self.lower:
                page.keep = Keep.DIRTY
                self._writes.queue(page.key, now)
            if page.announce is not None:
                self._by_event_hash[page.announce.event_hash] = page.key
            self._ever.add(page.key)
        self._touch_chain(committed)
        self._events.extend(coalesce_stored(committed, self.block_size, self.medium))
        # Pages read back from the tier below are about to be served: not the ones to evict now.
        self._evict_to_watermark(protect={p.key for p in committed} if clean else frozenset())
        return len(committed)

    def remember(self, keys: Iterable[str]) -> None:
        """Pages this runner holds outside DRAM (its NVMe tier found them at start)."""
        self._ever.update(keys)

    def ever_held(self, key: str) -> bool:
        """Whether `key` was committed here lately (see RecentKeys)."""
        return key in self._ever

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
                self._free_discarded(page)
            else:
                released.append(page)
        self._touch_chain(released)

    def _free_discarded(self, page: Page) -> None:
        if page.num_claims == 0 and not self._writes.is_writing(page.slot):
            del self._discarding[page.slot]
            self._slots.free(page.slot)

    def is_live(self, page: Page) -> bool:
        """True while the slot still holds this page's bytes (same generation, not freed)."""
        return page.state is not State.FILLING and self._slots.generation(page.slot) == page.generation \
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
        self._writes.discard(page.key)
        if page.announce is not None and self._by_event_hash.get(page.announce.event_hash) == page.key:
            del self._by_event_hash[page.announce.event_hash]
        if page.num_claims or self._writes.is_writing(page.slot):
            page.state = State.DISCARDING
            self._discarding[page.slot] = page
        else:
            self._slots.free(page.slot)

    def _num_evictable(self, n: int, protect: dict | set, *, dirty: bool) -> int:
        """How many unclaimed READY pages outside `protect` eviction may take (DIRTY ones only when
        `dirty`), counting up to n."""
        return len(self._victims(n, protect, dirty=dirty))

    def _victims(self, n: int, protect: dict | set, *, dirty: bool) -> list[Page]:
        return victims(self._lru, self._pages, n, protect, lower=self.lower, writing=self._writes.is_writing,
                       dirty=dirty)

    def _evict(self, n: int, protect: dict | set = frozenset(), *, dirty: bool = False) -> int:
        """Evict up to n unclaimed READY pages (see _victims), never one in `protect`."""
        return self._evict_pages(self._victims(n, protect, dirty=dirty))

    def _evict_pages(self, pages: list[Page]) -> int:
        for page in pages:
            if page.keep is not Keep.CLEAN:
                self.dropped[page.keep.value] += 1
            self._drop(page)
        self.num_evicted += len(pages)
        self._record_removed(pages)
        return len(pages)

    def _evict_to_watermark(self, protect: set[str] = frozenset()) -> None:
        """Evict down to the low watermark in strict LRU order: up to the first DIRTY page (it goes
        once written), so a chain loses its tail first however its pages were written."""
        used = self._slots.num_used
        if used > self._high:
            self._evict_pages(down_to_watermark(self._lru, self._pages, used - self._low, protect))

    def evict_to_watermark(self) -> int:
        """Evict (never DIRTY pages) down to the low watermark when above the high one."""
        before = self.num_evicted
        self._evict_to_watermark()
        return self.num_evicted - before

    def over_watermark(self) -> int:
        """Pages to evict to get from above the high watermark down to the low one (0: below it)."""
        used = self._slots.num_used
        return used - self._low if used > self._high else 0

    # --- the tier below ------------------------------------------------------------------------

    def take_dirty(self, n: int, *, lru: bool = False) -> list[Page]:
        """Hand up to n DIRTY pages to the writer: oldest committed first (write-behind), or least
        recently used first (`lru`: the ones eviction wants next). settle_written ends them."""
        if lru:
            keys = self._with_dirty_ancestors(list(islice((k for k in self._lru if k in self._writes), n)))
        else:
            keys = self._writes.oldest(n)
        pages = [self._pages[k] for k in keys]
        self._writes.begin(pages)
        return pages

    def _with_dirty_ancestors(self, keys: list[str]) -> list[str]:
        """`keys` with their DIRTY ancestors, each lineage root first: a spilled tail never reaches
        the tier below before the pages it continues."""
        out: list[str] = []
        seen: set[str] = set()
        for key in keys:
            lineage = []
            while key is not None and key not in seen and key in self._writes:
                seen.add(key)
                lineage.append(key)
                parent = self._pages[key].announce.parent_hash if self._pages[key].announce is not None else None
                key = self._by_event_hash.get(parent) if parent is not None else None
            out.extend(reversed(lineage))
        return out

    def settle_written(self, pages: Sequence[Page], keeps: Sequence[Keep]) -> None:
        """The writer is done with pages from take_dirty: CLEAN where the tier below took them,
        else the reason it did not (evicting them later drops them under that reason)."""
        for page, keep in zip(pages, keeps):
            self._writes.end(page.slot)
            if page.state is State.DISCARDING:
                self._free_discarded(page)
            elif page.keep is Keep.DIRTY:
                page.keep = keep
        self._evict_to_watermark()

    def mark_clean(self, keys: Iterable[str]) -> int:
        """READY pages the tier below holds already (promoted from it): nothing to write."""
        n = 0
        for key in keys:
            page = self._pages.get(key)
            if page is not None and page.state is State.READY and self._writes.discard(key):
                page.keep = Keep.CLEAN
                n += 1
        return n

    def mark_unkept(self, keys: Iterable[str], keep: Keep) -> None:
        """The tier below no longer holds these pages: evicting them now drops them (for `keep`)."""
        for key in keys:
            page = self._pages.get(key)
            if page is not None and page.keep is Keep.CLEAN:
                page.keep = keep

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
