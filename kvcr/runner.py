"""Runner: the DRAM region, its pools, claims and the event stream, behind one lock.

Metadata changes happen under the lock; page bytes are copied outside it, while the pages
are FILLING (invisible) or claimed (pinned), so a half-written page is never visible.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from .config import Config
from .drivers.shm import Region, region_name
from .proto.announce import Announce
from .proto.claims import Claim, ClaimTable, Fill, Release
from .proto.events import AllBlocksCleared, Event
from .proto.keys import Namespace, storage_key
from .proto.relay import RelayStep
from .proto.pool import PagePool, PageSizeError, PoolError, coalesce_stored


class UnknownPool(PoolError):
    pass


@dataclass(frozen=True, slots=True)
class PoolLayout:
    name: str
    offset: int
    stride: int
    page_bytes: int
    num_slots: int
    namespace: Namespace


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def plan_layout(cfg: Config) -> list[PoolLayout]:
    """Carve dram.size into pools; each slot starts on a dram.alignment boundary."""
    align = cfg.dram.alignment
    layouts, offset = [], 0
    for pool in cfg.dram.pools:
        size = cfg.pool_sizes()[pool.name]
        stride = _round_up(pool.page_bytes, align)
        layouts.append(PoolLayout(pool.name, offset, stride, pool.page_bytes, size // stride,
                                  cfg.namespace_for(pool)))
        offset = _round_up(offset + size, align)
    return layouts


class Runner:
    def __init__(self, cfg: Config, *, publish: Callable[[Sequence[Event]], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.incarnation = uuid.uuid4().hex[:16]
        self.clock = clock
        self.layouts = {p.name: p for p in plan_layout(cfg)}
        total = max(_round_up(p.offset + p.stride * p.num_slots, cfg.dram.alignment) for p in self.layouts.values())
        name = region_name(cfg.runner.name, os.getpid(), self.incarnation[:8])
        self.region = Region.create(name, total, lock_memory=cfg.dram.lock_memory)
        self.view = self.region.view
        self.pools = {p.name: PagePool(p.name, page_bytes=p.page_bytes, num_slots=p.num_slots,
                                       block_size=cfg.runner.block_size, high_watermark=cfg.dram.high_watermark,
                                       low_watermark=cfg.dram.low_watermark) for p in self.layouts.values()}
        self.claims = ClaimTable(max_claim_fraction=cfg.dram.max_claim_fraction)
        self.lock = threading.RLock()
        self._publish = publish or (lambda events: 0)
        self.hits = 0
        self.misses = 0

    # --- helpers -----------------------------------------------------------------------------

    def pool(self, name: str) -> PagePool:
        try:
            return self.pools[name]
        except KeyError:
            raise UnknownPool(f"unknown pool {name!r}; this runner has {sorted(self.pools)}") from None

    def key(self, pool: str, page_hex: str) -> str:
        return storage_key(page_hex, self.layouts[pool].namespace.digest)

    def offset(self, pool: str, slot: int) -> int:
        layout = self.layouts[pool]
        return layout.offset + slot * layout.stride

    def _flush_events(self) -> None:
        events: list[Event] = []
        for pool in self.pools.values():
            events.extend(pool.take_events())
        if events:
            self._publish(events)

    # --- fills -------------------------------------------------------------------------------

    def reserve(self, pool: str, keys: Sequence[str], announces: Sequence[Announce | None] | None = None, *,
                owner: str = "local", lease_s: float | None = None, writer_pid: int = 0) -> Fill:
        with self.lock:
            fill = self.claims.reserve(self.pool(pool), keys, announces, owner=owner,
                                       lease_s=lease_s or self.cfg.runner.lease_seconds, now=self.clock(),
                                       writer_pid=writer_pid)
            self._flush_events()  # room may have been made by eviction
            return fill

    def commit(self, fill_id: int, ok: Sequence[bool] | None = None, *, owner: str = "local") -> int:
        with self.lock:
            n = self.claims.commit(fill_id, owner=owner, ok=ok)
            self._flush_events()
            return n

    def put(self, pool: str, keys: Sequence[str], pages: Sequence[bytes | memoryview],
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
            view, stride, base = self.view, layout.stride, layout.offset
            for page, data in zip(fill.pages, pages):
                if page is not None:
                    start = base + page.slot * stride
                    view[start:start + layout.page_bytes] = data
        except BaseException:
            ok = False
            raise
        finally:
            self.commit(fill.fill_id, None if ok else [False] * len(keys))
        return len(keys)

    # --- reads -------------------------------------------------------------------------------

    def lookup(self, pool: str, keys: Sequence[str]) -> int:
        with self.lock:
            return self.pool(pool).leading_ready(keys)

    def claim(self, pool: str, keys: Sequence[str], *, owner: str = "local", lease_s: float | None = None) -> Claim:
        with self.lock:
            p = self.pool(pool)
            claim = self.claims.claim(p, keys, owner=owner, lease_s=lease_s or self.cfg.runner.lease_seconds,
                                      now=self.clock())
            self.hits += len(claim.pages)
            self.misses += len(keys) - len(claim.pages)
            p.touch(keys[:len(claim.pages)])
            return claim

    def renew(self, claim_id: int, *, owner: str = "local") -> float:
        with self.lock:
            return self.claims.renew(claim_id, owner=owner, now=self.clock())

    def release(self, claim_id: int, *, owner: str = "local") -> Release:
        with self.lock:
            result = self.claims.release(claim_id, owner=owner)
            self._flush_events()
            return result

    def get(self, pool: str, keys: Sequence[str]) -> list[bytes]:
        """Copies of the leading run of present pages (shorter than `keys` on a miss)."""
        claim = self.claim(pool, keys)
        layout = self.layouts[pool]
        try:
            return [bytes(self.view[layout.offset + p.slot * layout.stride:
                                    layout.offset + p.slot * layout.stride + layout.page_bytes])
                    for p in claim.pages]
        finally:
            if claim.pages:
                self.release(claim.claim_id)

    def read_into(self, pool: str, keys: Sequence[str], buffers: Sequence[memoryview]) -> int:
        """Copy the leading present pages into caller buffers; returns how many were copied."""
        claim = self.claim(pool, keys)
        layout = self.layouts[pool]
        try:
            for page, buf in zip(claim.pages, buffers):
                start = layout.offset + page.slot * layout.stride
                buf[:layout.page_bytes] = self.view[start:start + layout.page_bytes]
            return len(claim.pages)
        finally:
            if claim.pages:
                self.release(claim.claim_id)

    # --- inventory ---------------------------------------------------------------------------

    def remove(self, pool: str, keys: Sequence[str]) -> int:
        with self.lock:
            n = self.pool(pool).remove(keys)
            self._flush_events()
            return n

    def inventory(self) -> list[Event]:
        """The whole announced inventory as BlockStored events (call under the lock)."""
        events: list[Event] = []
        for pool in self.pools.values():
            events.extend(coalesce_stored(pool.ready_pages(), pool.block_size, pool.medium))
        return events

    def relay(self, step: RelayStep) -> None:
        """Publish relayed engine events; a resync first clears and re-announces our own pages."""
        with self.lock:
            self._flush_events()
            if step.resync:
                self._publish([AllBlocksCleared(), *self.inventory(), *step.events])
            elif step.events:
                self._publish(step.events)

    def announce_start(self) -> None:
        """First batch of an incarnation: clear what routers believe, then re-announce what we hold."""
        with self.lock:
            self._publish([AllBlocksCleared(), *self.inventory()])

    def expire(self) -> list[int]:
        with self.lock:
            gone = self.claims.expire(self.clock(), writer_alive=_pid_alive)
            self._flush_events()
            return gone

    def shutdown(self) -> None:
        """Announce the removal of everything held, then unmap and unlink the region."""
        with self.lock:
            for pool in self.pools.values():
                pool.clear()
            self._flush_events()
        self.view.release()
        self.region.close()

    def info(self) -> dict:
        return {"pools": [{"name": p.name, "page_bytes": p.page_bytes, "stride": p.stride, "offset": p.offset,
                           "num_slots": p.num_slots, "namespace": p.namespace.fields(),
                           "namespace_digest": p.namespace.digest} for p in self.layouts.values()],
                "shm_path": self.region.path, "shm_size": self.region.size}
