"""`KVCRStorage`: SGLang's HiCache L3 backend on a kvcr runner (hosted in-process, TP = 1).

Exact lookups: `batch_exists` counts the local leading pages, then, when a hint names a peer for
the rest, claims them there, so the pages it counts are pinned at their source until `batch_get_v1`
collects them (a local page can still be evicted meanwhile: the read then stops short, and only
what arrived whole is reported). A claim SGLang never collects is given back after its lease.
"""

from __future__ import annotations

import logging
import threading
from enum import Enum

import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransferResult,
)

from kvcr.drivers.claim_holder import ClaimHolder
from kvcr.proto.announce import Announce
from kvcr.proto.pool import PoolError
from kvcr.peer_pulls import PeerPulls
from kvcr.runner import TIER_ABSENT, Runner
from kvcr.service import Service

from . import hooks
from .config import parse_adapter_config
from .dp import dp_placement
from .lookup import ConfirmedLookup
from .host_pages import HostPages
from .keeper import Keeper
from .layout import KeyLayout, LayoutError
from .runner_setup import POOL, key_layout, runner_config
from .pagemeta import AnnounceChain, plain_key_events, restorable
from .peering import Peering
from .transfer_stats import TransferStats
from .hint_source import request_hint_source, request_hints

log = logging.getLogger(__name__)

hooks.install_if_launched()


def _pool_name(name) -> str:
    """SGLang names pools with a str enum (PoolName) or a plain string; the runner with the value."""
    return name.value if isinstance(name, Enum) else str(name)


class KVCRStorage(ConfirmedLookup, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        self.cfg = parse_adapter_config(extra)  # AdapterConfigError names a bad key
        self.storage_config = storage_config
        self.interface_v1 = bool(extra.get("interface_v1"))
        if storage_config.should_split_heads:
            raise ValueError("kvcr: page_head split (heterogeneous TP) is not supported")
        if storage_config.tp_size > 1 or storage_config.pp_size > 1:
            raise ValueError(f"kvcr: tp_size {storage_config.tp_size} / pp_size {storage_config.pp_size}: the "
                             "in-process runner serves TP = PP = 1; with TP > 1 run a `kvcr serve` sidecar per worker "
                             "and set the extra-config 'sidecar' (class KVCRSidecarStorage, docs/sglang.md)")
        # Span mode (SGLang after 0.5.23): one storage key covers storage_page_size tokens.
        self.storage_page_size = getattr(storage_config, "storage_page_size", None)
        self.service: Service | None = None
        self.peering: Peering | None = None  # with the runner: our registry entry, the peers we follow
        self.layouts: dict[str, KeyLayout] = {}  # per host pool: what one key holds of it
        self.mem_pool_host = None
        self.claims: ClaimHolder | None = None  # with the runner's puller: the claims we take at peers
        self.host: HostPages | None = None  # with the runner
        self._start_lock = threading.Lock()
        self._chain: AnnounceChain | None = None  # made once the KV pool's page size is known
        self.stats = TransferStats()

    supports_page_spans = True  # the capability upstream's factory asks for before span mode

    # --- attach ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        try:
            self.layouts[POOL] = key_layout(mem_pool_host, self.layouts, self.storage_page_size)
        except LayoutError:  # a hybrid model's logical anchor has no pages: its KV pool comes via v2
            log.info("kvcr: the anchor host pool has no page buffers; waiting for the v2 pools")

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        if name not in self.layouts:
            self.layouts[name] = key_layout(host_pool, self.layouts, self.storage_page_size)

    def on_host_pools_registered(self) -> None:
        """Every host pool is registered: SGLang 0.5.23 says so, the hooks do before it (without
        them the runner starts at the first storage call)."""
        self._start()

    def _start(self) -> Service:
        with self._start_lock:
            if self.service is None:
                if not self.layouts:
                    raise RuntimeError("kvcr: no host pool with page buffers was registered")
                service = Service(runner_config(self.storage_config, self.cfg, self.layouts,
                                                interface_v1=self.interface_v1, placement=dp_placement())).start()
                if service.claims is not None:  # claims we take outlive an uncollected prefetch
                    service.claims.ask_lease(self.cfg.claim_lease_s)
                    self.claims = service.claims
                self.peering = Peering.join(self.cfg, service)
                self.host = HostPages(service.runner, service.pulls, self.claims, self.layouts, self.stats,
                                      Keeper(), anchor=self.mem_pool_host)
                self.service = service  # last: a lookup that sees the service sees its parts
            return self.service

    @property
    def runner(self) -> Runner:
        return (self.service or self._start()).runner

    @property
    def pulls(self) -> PeerPulls:
        return (self.service or self._start()).pulls

    # --- lookups -----------------------------------------------------------------------------

    def _keys(self, keys: list[str], pool: str = POOL) -> list[str]:
        return self.runner.keys(pool, keys)

    def _held_here(self, keys: list[str]) -> int:
        tiers = self.runner.tiers(POOL, self._keys(keys))
        return next((i for i, t in enumerate(tiers) if t == TIER_ABSENT), len(keys))

    def _claim_holder(self) -> ClaimHolder | None:
        return self.claims

    def _claim_beyond(self, keys: list[str], local: int, owner: str | None, extra_info) -> int:
        if self.claims is None:  # no UCX data plane: peers cannot be pulled from
            return local
        source = self._source(keys, local, extra_info)
        if source is None:
            return local
        # One claim per SGLang transfer batch (the controller reads in batches of
        # STORAGE_BATCH_SIZE from the first key), so each batch's pull is one claim that ends with it.
        endpoint, depth = source
        return self.claims.confirm(endpoint, POOL, keys, local, depth, owner, batch=STORAGE_BATCH_SIZE)

    def _source(self, keys: list[str], local: int, extra_info) -> tuple[str, int] | None:
        """(endpoint, pages from `local`) a hint names: the request's own, else one the router posted."""
        hinted = request_hints(extra_info)
        dims = self.layouts[POOL].page.page_size, self.layouts[POOL].pages
        if hinted is not None and self.cfg.use_request_hints:
            source = request_hint_source(hinted, keys[local:], *dims)
            if source is not None:
                return source
        events = hinted.key_events(keys[local:], *dims) if hinted is not None else plain_key_events(keys[local:])
        if self.cfg.use_posted_hints:
            posted = self.pulls.hinted_source(events)
            if posted is not None:
                return posted.endpoint, posted.num_pages
        return self.peering.best_source(events)  # no hint: whoever announced the pages on its event stream

    def _expire_pending(self) -> None:
        """Give back claims SGLang never collected (a prefetch that ended or was revoked)."""
        if self.claims is not None:
            self.claims.expire()

    @property
    def num_claims_expired(self) -> int:
        return self.claims.num_expired if self.claims is not None else 0

    def engine_hit(self, keys: list[str]) -> None:
        """The engine served these pages from its own pools (hooks): a use, as a read is."""
        self.runner.touch(POOL, self._keys(keys))

    def prefetch_ended(self, keys: list[str], request_id: str | None = None) -> None:
        """The scheduler stopped or revoked a request's prefetch (launcher hook): give back the
        claims it will not collect and no other request counts on."""
        if self.claims is not None:
            self.claims.prefetch_ended(keys, request_id)

    def _take_pending(self, keys: list[str]) -> None:
        """Byte-copy reads: pull what batch_exists confirmed for these keys into the runner."""
        pos = self.runner.lookup(POOL, self._keys(keys))
        while pos < len(keys) and self.claims is not None and (p := self.claims.take(keys, pos)) is not None:
            got = self.pulls.take_confirmed(p)
            self.stats.from_peers(got)
            if got < len(p.page_hexes):
                break
            pos += got

    # --- zero-copy interface -------------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._read(POOL, keys, host_indices, self.mem_pool_host)

    def _read(self, name: str, keys: list[str], host_indices: torch.Tensor, host_pool) -> list[bool]:
        self._expire_pending()
        return self._host_pages().read(name, keys, host_indices, host_pool)

    def _write(self, name: str, keys: list[str], host_indices: torch.Tensor, host_pool,
               announces: list[Announce] | None = None) -> list[bool]:
        return self._host_pages().write(name, keys, host_indices, host_pool, announces)

    def _host_pages(self) -> HostPages:
        if self.host is None:
            self._start()
        return self.host


    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._write(POOL, keys, host_indices, self.mem_pool_host, self._announces(keys, extra_info))

    # --- v2: several host pools per key (hybrid models; span mode) ------------------------------

    def _transfers(self, transfers, io) -> dict[str, list[bool]]:
        out = {}
        for t in transfers:
            name, keys = _pool_name(t.name), list(t.keys or [])
            if name not in self.layouts:
                log.warning("kvcr: pool %s was never registered", name)
                out[t.name] = [False] * len(keys)
                continue
            try:
                out[t.name] = io(name, keys, t.host_indices, self.registered_pools[t.name])
            except LayoutError as exc:  # the transfer's slots do not fit the pool's stride: refused
                log.warning("kvcr: %s transfer refused: %s", name, exc)
                out[t.name] = [False] * len(keys)
        return out

    def batch_get_v2(self, transfers, extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._transfers(transfers, self._read)

    def batch_set_v2(self, transfers, extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._transfers(transfers, self._write)

    def batch_exists_v2(self, keys: list[str], pool_transfers=None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """KV's leading hit (peers included), cut to where every other pool can restore too."""
        kv = self.batch_exists(keys, extra_info)
        hits = {PoolName.KV: kv} if kv else {}
        prefixes = set(range(1, kv + 1))
        for t in pool_transfers or []:
            name = _pool_name(t.name)
            held = [tier != TIER_ABSENT for tier in self.runner.tiers(name, self._keys(keys[:kv], name))] \
                if name in self.layouts else [False] * kv
            ok = restorable(held, PoolHitPolicy(t.hit_policy).value, len(t.keys or ()) or 1)
            if ok:
                hits[t.name] = max(ok)
            prefixes &= ok
        return PoolTransferResult(max(prefixes, default=0), hits, sorted(prefixes))

    def _announces(self, keys: list[str], extra_info) -> list[Announce] | None:
        """SGLang 0.5.23 passes no tokens unless the launcher's backup hook adds them: such pages
        are stored and served, not announced."""
        if extra_info is None:
            return None
        if self._chain is None:
            self._chain = AnnounceChain(self.layouts[POOL].page.page_size, self.layouts[POOL].pages)
        return self._chain.announces(keys, extra_info.extra_info or {}, extra_info.prefix_keys)

    # --- byte-copy interface (no interface_v1) -----------------------------------------------

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        self._take_pending(list(keys))
        runner = self.runner
        out: list = [None] * len(keys)
        with runner.pinned(POOL, self._keys(list(keys))) as pages:
            for i, page in enumerate(pages):
                src = runner.slot_view(POOL, page)
                target = target_locations[i] if target_locations is not None else \
                    torch.empty(len(src), dtype=torch.uint8)
                target.view(torch.uint8).reshape(-1).numpy()[:] = src
                out[i] = target
        return out

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        data = [v.contiguous().view(torch.uint8).reshape(-1).numpy() for v in values]
        try:
            self.runner.put(POOL, self._keys(list(keys)), data)
        except PoolError as exc:
            log.warning("kvcr: backup of %d pages refused: %s", len(keys), exc)
            return False
        return True

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    # --- admin -------------------------------------------------------------------------------

    def wait_kept(self) -> None:
        """Wait until the pages pulled so far are kept in the runner (they are copied there after
        the read that delivered them returns)."""
        if self.host is not None:
            self.host.keeper.fence()

    def clear(self) -> None:
        self.wait_kept()  # no keep commits into a cleared runner
        for name in self.layouts:
            self.runner.clear(name)

    def get_stats(self):
        return self.stats.report(self.layouts[POOL].bytes)

    def claims_pending(self) -> int:
        return len(self.claims) if self.claims is not None else 0

    def close(self) -> None:
        if self.peering is not None:
            self.peering.close()
            self.peering = None
        if self.service is not None:
            if self.host is not None:
                self.host.keeper.close()  # what is queued is kept before the runner stops
            if self.claims is not None:
                self.claims.close()  # kept: its counts stay readable
            self.service.stop()
            self.service = None
            self.host = None
