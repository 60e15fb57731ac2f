"""Runner: the DRAM core, that is the region, its pools and claims, behind one lock; what they
change goes out through its EventStream (events.py).

Metadata changes happen under the lock; page bytes are copied outside it, while the pages
are FILLING (invisible) or claimed (pinned), so a half-written page is never visible. The tier
below DRAM is whatever `LowerTier` it was built with (lower.py); it knows nothing else of the
layer: shard assembly and the NVMe tier are joined to it by the store (store.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import xxhash

from ..config import Config
from ..drivers.shm import Region, host_id, region_name
from ..proto.announce import Announce
from ..proto.claims import Busy, Claim, ClaimError, ClaimTable, Fill
from ..proto.events import Event
from ..proto.keys import StorageKey, storage_keys
from ..proto.page import Page
from ..proto.pool import PagePool, PageSizeError, PoolBusy, PoolError
from ..proto import messages as m
from ..proto.source import ClaimSource, Released
from .events import EventStream
from .layout import plan_layout, round_up
from .lower import DramSide, LowerTier, NoLowerTier
from .statistics import RunnerStatistics, gather_statistics


class UnknownPool(PoolError):
    pass


TIER_ABSENT, TIER_DRAM, TIER_NVME = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Grant:
    claim: Claim
    reply: m.Granted  # what the peer is told: region offsets, generations, lease, announces, digests


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Runner:
    def __init__(self, cfg: Config, *, publish: Callable[[Sequence[Event]], int] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 lower: Callable[[DramSide], LowerTier] | None = None) -> None:
        if cfg.nvme.storage_dir and lower is None:
            raise ValueError("nvme.storage_dir is set but no tier below DRAM was given: open the runner with "
                             "kvcr.runner.open_store, which builds its NVMe tier")
        self.cfg = cfg
        self.incarnation = uuid.uuid4().hex[:16]
        self.clock = clock
        self.layouts = {p.name: p for p in plan_layout(cfg)}
        total = max(round_up(p.offset + p.stride * p.num_slots, cfg.dram.alignment) for p in self.layouts.values())
        name = region_name(cfg.runner.name, os.getpid(), self.incarnation[:8])
        self.region = Region.create(name, total, lock_memory=cfg.dram.lock_memory)
        self.view = self.region.view
        self.region_address = self.region.address
        # With a tier below, committed pages are DIRTY until it has written them, and eviction
        # takes CLEAN pages first (see PagePool).
        self.pools = {p.name: PagePool(p.name, page_bytes=p.page_bytes, num_slots=p.num_slots,
                                       block_size=cfg.runner.block_size, high_watermark=cfg.dram.high_watermark,
                                       low_watermark=cfg.dram.low_watermark, lower=lower is not None)
                      for p in self.layouts.values()}
        self.claims = ClaimTable(max_claim_fraction=cfg.dram.max_claim_fraction,
                                 max_claims_per_owner=cfg.runner.max_claims_per_peer)
        self.source = ClaimSource(self.claims, default_lease_s=cfg.runner.lease_seconds)  # peers' claims
        self.lock = threading.RLock()
        self.hits = 0
        self.misses = 0
        self.unheld: Counter[str] = Counter()  # pages peers claimed that we do not hold, by cause
        self._lower: LowerTier = lower(self) if lower is not None else NoLowerTier()  # it uses the lock
        self.events = EventStream(self.pools, self._lower, publish or (lambda events: 0), self.lock)

    # --- helpers -----------------------------------------------------------------------------

    def pool(self, name: str) -> PagePool:
        try:
            return self.pools[name]
        except KeyError:
            raise UnknownPool(f"unknown pool {name!r}; this runner has {sorted(self.pools)}") from None

    def key(self, pool: str, page_hex: str) -> StorageKey:
        return self.keys(pool, [page_hex])[0]

    def keys(self, pool: str, page_hexes: Sequence[str]) -> list[StorageKey]:
        digest = self.layouts[pool].namespace.digest  # once per request, not per page
        return storage_keys(page_hexes, digest)

    def page_geometry(self, pool: str) -> tuple[int, int]:
        """(page bytes, TP shards side by side in a page) of a pool (UnknownPool if none)."""
        layout = self.layouts[self.pool(pool).name]
        return layout.page_bytes, layout.shards

    def capacity(self, pool: str) -> int:
        """Slots in the pool (fixed at start)."""
        return self.pool(pool).capacity

    def offset(self, pool: str, slot: int) -> int:
        layout = self.layouts[pool]
        return layout.offset + slot * layout.stride

    def flush_events(self) -> None:
        """Publish what changed (under the lock)."""
        self.events.flush()

    def flush_events_locked(self) -> None:
        with self.lock:
            self.flush_events()

    def slot_view(self, pool: str, page: Page) -> memoryview:
        layout = self.layouts[pool]
        start = layout.offset + page.slot * layout.stride
        return self.view[start:start + layout.page_bytes]

    # --- fills -------------------------------------------------------------------------------

    def reserve(self, pool: str, keys: Sequence[StorageKey], announces: Sequence[Announce | None] | None = None, *,
                owner: str = "local", lease_s: float | None = None, writer_pid: int = 0) -> Fill:
        """Reserve slots for `keys`. When only DIRTY pages could make room, wait up to
        nvme.dirty_wait_s for the persister to write them, then drop the least recently used ones
        (counted under `nvme_lagging`)."""
        p = self.pool(pool)
        deadline = None
        with self.lock:
            while True:
                try:
                    fill = self.claims.reserve(p, keys, announces, owner=owner,
                                               lease_s=lease_s or self.cfg.runner.lease_seconds, now=self.clock(),
                                               writer_pid=writer_pid,
                                               evict_dirty=deadline is not None and time.monotonic() >= deadline)
                    break
                except PoolBusy as busy:
                    deadline = self._lower.wait_for_writer(pool, busy, deadline)
            if deadline is not None:
                self._lower.waited(deadline)
            self.flush_events()  # room may have been made by eviction
            return fill

    def fill(self, fill_id: int) -> Fill:
        """An open fill (ClaimError naming why when it is not: committed, aborted or expired)."""
        with self.lock:
            return self.claims.fill(fill_id)

    def commit(self, fill_id: int, ok: Sequence[bool] | None = None, *, owner: str = "local",
               clean: bool = False) -> int:
        """Make a fill's pages visible (`ok`: per page, False frees it). `clean`: the pages were read
        from NVMe, which keeps them, so the persister has nothing to write."""
        if self.cfg.page_digests:
            self._digest_fill(fill_id, ok)
        with self.lock:
            n = self.claims.commit(fill_id, owner=owner, ok=ok, now=self.clock(), clean=clean)
            self.flush_events()
        if n and not clean:
            self._lower.committed()
        return n

    def _digest_fill(self, fill_id: int, ok: Sequence[bool] | None) -> None:
        """Digest the pages a fill is about to make visible: a pull checks its bytes against it, so
        a page changed after commit (by anything but the runner) is refused, never delivered."""
        with self.lock:
            try:
                fill = self.claims.fill(fill_id)
            except ClaimError:
                return  # the commit itself refuses it, naming why
            if ok is not None and len(ok) != len(fill.pages):
                return
            pages = [p for i, p in enumerate(fill.pages) if isinstance(p, Page) and (ok is None or ok[i])]
        for page in pages:  # FILLING: invisible, and its writer is done with it
            page.digest = xxhash.xxh3_64_intdigest(self.slot_view(fill.pool.name, page))

    def page_digest(self, pool: str, page: Page) -> int:
        """The page's digest from its commit, or (a runner keeping none) of its bytes now."""
        return page.digest if page.digest is not None else xxhash.xxh3_64_intdigest(self.slot_view(pool, page))

    def put(self, pool: str, keys: Sequence[StorageKey], pages: Sequence[bytes | memoryview],
            announces: Sequence[Announce | None] | None = None) -> int:
        """Store whole pages (bytes-like, exactly page_bytes each). Keys already present count as stored."""
        self.pool(pool)
        layout = self.layouts[pool]
        if len(pages) != len(keys):
            raise PageSizeError(f"{len(keys)} keys but {len(pages)} pages")
        for i, page in enumerate(pages):
            if len(page) != layout.page_bytes:
                raise PageSizeError(f"page {i} for pool {pool!r} is {len(page)} bytes; the pool's page size is "
                                    f"{layout.page_bytes}")
        # This thread commits or aborts in `finally`, so its fill needs no lease.
        fill = self.reserve(pool, keys, announces, lease_s=math.inf)
        ok = True
        try:
            view, stride, base, size = self.view, layout.stride, layout.offset, layout.page_bytes
            for page, data in zip(fill.pages, pages):
                if isinstance(page, Page):  # inlined slot_view: this loop is the put hot path
                    start = base + page.slot * stride
                    view[start:start + size] = data
        except BaseException:
            ok = False
            raise
        finally:
            self.commit(fill.fill_id, None if ok else [False] * len(keys))
        return len(keys)

    # --- reads -------------------------------------------------------------------------------

    def lookup(self, pool: str, keys: Sequence[StorageKey]) -> int:
        with self.lock:
            return self.pool(pool).leading_ready(keys)

    def tiers(self, pool: str, keys: Sequence[StorageKey]) -> list[int]:
        """Per key: TIER_ABSENT, TIER_DRAM or TIER_NVME (DRAM wins when a page is in both)."""
        p = self.pool(pool)
        with self.lock:
            in_dram = [p.get(k) is not None for k in keys]
            on_disk = self._lower.on_disk(pool, keys)
        return [TIER_DRAM if d else TIER_NVME if n else TIER_ABSENT for d, n in zip(in_dram, on_disk)]

    def holds_event_hash(self, event_hash: int) -> bool:
        """Whether a page with this (int64) event hash is in DRAM or on NVMe (under the lock)."""
        return any(p.key_for_event_hash(event_hash) is not None for p in self.pools.values()) \
            or self._lower.holds_event_hash(event_hash)

    def touch(self, pool: str, keys: Sequence[StorageKey]) -> None:
        """The pages were used elsewhere (an engine's own copy served them): most recent in DRAM."""
        with self.lock:
            self.pool(pool).touch(keys)

    def claim(self, pool: str, keys: Sequence[StorageKey], *, owner: str = "local", lease_s: float | None = None) -> Claim:
        """Pin the leading present pages; NVMe pages right after the DRAM run are promoted first."""
        self._lower.complete_run(pool, keys)
        with self.lock:
            p = self.pool(pool)
            claim = self.source.claim(p, keys, owner=owner, lease_s=lease_s, now=self.clock())
            self.hits += len(claim.pages)
            self.misses += len(keys) - len(claim.pages)
            return claim

    def grant(self, pool: str, keys: Sequence[StorageKey], *, owner: str, lease_s: float | None = None,
              digests: bool = False, registered: Callable[[Sequence[int], int], bool] | None = None,
              inline_max: int = 0) -> Grant:
        """A peer's claim: the leading present pages pinned, with their region offsets (and commit
        digests when asked). Pages not yet registered for peers' GETs (`registered`) refuse the
        whole claim as Busy, a miss the peer retries; a claim that cannot be answered is released.
        Pages that come to at most `inline_max` bytes are answered with their bytes instead, read
        under the claim, which then ends here (the peer has nothing left to read)."""
        claim = self.claim(pool, keys, owner=owner, lease_s=lease_s)
        ended = False
        try:
            if len(claim.pages) < len(keys):
                self._count_unheld(pool, keys[len(claim.pages):])
            offsets = [self.offset(pool, p.slot) for p in claim.pages]
            page_bytes = self.layouts[pool].page_bytes
            inline = bool(claim.pages) and len(claim.pages) * page_bytes <= inline_max
            if not inline and registered is not None and not registered(offsets, page_bytes):
                raise Busy("these pages are not registered for peers yet; retry shortly")
            sums = [self.page_digest(pool, p) for p in claim.pages] if digests else []
            reply = self.source.granted(claim, offsets, sums)
            if inline:
                reply = dataclasses.replace(reply, data=self._copy_out(pool, claim.pages))
                ended = True
                self.release(claim.claim_id, owner=owner)
            return Grant(claim, reply)
        except BaseException:
            if claim.pages and not ended:  # no answer, no claim
                self.release(claim.claim_id, owner=owner)
            raise

    def _copy_out(self, pool: str, pages: Sequence[Page]) -> bytes:
        """The pages' bytes back to back (they are claimed: nothing rewrites them meanwhile)."""
        return b"".join(self.slot_view(pool, page) for page in pages)

    def _count_unheld(self, pool: str, keys: Sequence[StorageKey]) -> None:
        """A peer asked for pages past what we could claim: ones we let go (an eviction race) are
        counted apart from ones we never held (the router that named us was wrong)."""
        p = self.pool(pool)
        absent = [k for k, tier in zip(keys, self.tiers(pool, keys)) if tier == TIER_ABSENT]
        evicted = sum(map(p.ever_held, absent))
        with self.lock:
            self.unheld["evicted"] += evicted
            self.unheld["never_held"] += len(absent) - evicted

    def renew(self, claim_id: int, *, owner: str = "local") -> m.Renewed:
        with self.lock:
            return self.source.renew(claim_id, owner=owner, now=self.clock())

    def release(self, claim_id: int, *, owner: str = "local", drop: int = 0) -> Released:
        """End a claim. `drop` (move mode): remove, in every tier, the first `drop` claimed pages
        that stayed live (the ones the puller verifiably received)."""
        with self.lock:
            result = self.source.release(claim_id, owner=owner, drop=drop)
            self.flush_events()
        if result.moved:
            self.remove(result.pool, list(result.moved))
        return result

    def quarantine(self, fill_id: int) -> int:
        """A fill whose slots a transfer may still write: they are never handed out again."""
        with self.lock:
            n = self.claims.quarantine(fill_id, owner="local")
            self.flush_events()
        return n

    @contextmanager
    def pinned(self, pool: str, keys: Sequence[StorageKey]) -> Iterator[list[Page]]:
        """Pin the leading present pages (promoting from NVMe) for a local copy, then unpin.

        A local copy is bounded by this call, so it takes no lease and no share of the claim limit.
        """
        self._lower.complete_run(pool, keys)
        with self.lock:
            p = self.pool(pool)
            pages = p.pin_prefix(keys, len(keys))
            self.hits += len(pages)
            self.misses += len(keys) - len(pages)
        try:
            yield pages
        finally:
            with self.lock:
                p.unpin(pages)
                self.flush_events()

    def pin_claimed(self, claim_id: int, owner: str, ranges: Sequence[tuple[int, int]]
                    ) -> tuple[PagePool, list[Page]] | None:
        """Pin the claim's pages once more (for sends that may outlive its lease) if every (region
        offset, nbytes) lies on whole pages of the claim; None otherwise."""
        with self.lock:
            claim = self.claims.held(claim_id, owner)
            layout = self.layouts[claim.pool.name]
            held = {self.offset(layout.name, p.slot) for p in claim.pages}
            step = layout.page_bytes
            for offset, nbytes in ranges:
                if nbytes <= 0 or nbytes % step or (nbytes > step and layout.stride != step):
                    return None
                if any(o not in held for o in range(offset, offset + nbytes, step)):
                    return None
            claim.pool.pin_pages(claim.pages)
            return claim.pool, list(claim.pages)

    def unpin(self, pool: PagePool, pages: Sequence[Page]) -> None:
        with self.lock:
            pool.unpin(pages)
            self.flush_events()

    def get(self, pool: str, keys: Sequence[StorageKey]) -> list[bytes]:
        """Copies of the leading run of present pages (shorter than `keys` on a miss)."""
        with self.pinned(pool, keys) as pages:
            return [bytes(self.slot_view(pool, p)) for p in pages]

    def read_into(self, pool: str, keys: Sequence[StorageKey], buffers: Sequence[memoryview]) -> int:
        """Copy the leading present pages into caller buffers; returns how many were copied."""
        size = self.pool(pool).page_bytes
        short = [i for i, buf in enumerate(buffers) if len(buf) < size]
        if short:
            raise PageSizeError(f"buffer {short[0]} holds {len(buffers[short[0]])} bytes; pool {pool!r} pages are "
                                f"{size}")
        with self.pinned(pool, keys[:len(buffers)]) as pages:
            for page, buf in zip(pages, buffers):
                buf[:size] = self.slot_view(pool, page)
            return len(pages)

    def statistics(self) -> RunnerStatistics:
        with self.lock:
            return gather_statistics(self.pools, self.claims.statistics(), self._lower, self.clock(),
                                     hits=self.hits, misses=self.misses, unheld=self.unheld)

    # --- removal -----------------------------------------------------------------------------

    def remove(self, pool: str, keys: Sequence[StorageKey]) -> int:
        """Drop pages from every tier. Returns pages removed from DRAM plus pages removed from NVMe."""
        with self.lock:
            n = self.pool(pool).remove(keys)
            self.flush_events()
        return n + self._lower.remove(pool, [k.page_hex for k in keys])

    def clear(self, pool: str) -> int:
        """Drop every page of `pool` from DRAM and NVMe (SGLang's /flush_cache). Returns pages removed."""
        with self.lock:
            keys = [p.key for p in self.pool(pool).ready_pages()]
            on_disk = self._lower.page_hexes(pool)
        return self.remove(pool, keys) + self._lower.remove(pool, on_disk)

    def expire(self) -> list[int]:
        """End the claims and fills whose lease ran out; returns the ids of those that ended."""
        with self.lock:
            gone = self.source.expire(self.clock(), writer_alive=_pid_alive)
            self.flush_events()
        return gone

    def shutdown(self) -> None:
        """Announce the removal of everything DRAM holds, then unmap and unlink the region (the
        store flushes and closes the tier below first)."""
        with self.lock:
            for pool in self.pools.values():
                pool.clear()
            self.flush_events()
        self.view.release()
        self.region.close()

    def info(self) -> dict:
        return {"pools": [{"name": p.name, "page_bytes": p.page_bytes, "stride": p.stride, "offset": p.offset,
                           "num_slots": p.num_slots, "namespace": p.namespace.fields(),
                           "namespace_digest": p.namespace.digest} for p in self.layouts.values()],
                "shm_path": self.region.path, "shm_size": self.region.size, "host_id": host_id()}
