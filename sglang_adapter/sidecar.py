"""`KVCRSidecarStorage`: every TP rank of an SGLang worker attaches to one `kvcr serve` sidecar
(per worker and DP rank) that owns the pages of all shards.

A sidecar page holds every rank's shard side by side (`dram.pools[].shards`); each rank writes
and reads its own slice through the sidecar's shared-memory pool (same host), and the sidecar
makes a page visible, announces it and evicts it as one: only when every shard is in. Under MLA
the ranks hold the same KV, so a page is one shard the writer rank backs up and every rank reads.
A request's hint makes each rank claim the pages at the peer's sidecar and GET its own slice
straight into its host pages; hints the router posted to our sidecar make the sidecar pull whole
pages, which the ranks then read locally.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvcr.client import AttachedWriter, ControlClient, ControlError
from kvcr.drivers.claim_holder import ClaimHolder
from kvcr.drivers.puller import Puller
from kvcr.proto import messages as m
from kvcr.proto.keys import Namespace
from kvcr.ranks import rank_endpoint

from . import hooks
from .config import AdapterConfigError, parse_adapter_config
from .dp import dp_placement
from .lookup import ConfirmedLookup, LookupFailed
from .layout import KeyLayout, PageLayout, gather, scatter
from .pagemeta import AnnounceChain, HintedRequest
from .hint_source import request_hint_source, request_hints

log = logging.getLogger(__name__)
hooks.install_if_launched()  # TP > 1 engines load this module, not storage.py
POOL = "kv"
SHARD_LEASE_S = 30.0  # every rank's backup of a batch must land within this, or the pages are dropped


class KVCRSidecarStorage(ConfirmedLookup, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.cfg = parse_adapter_config(storage_config.extra_config)
        if not self.cfg.sidecar:
            raise AdapterConfigError("kvcr extra-config 'sidecar' (the sidecar's control endpoint) is required for "
                                     "KVCRSidecarStorage")
        if storage_config.attn_cp_size > 1 or storage_config.pp_size > 1:
            raise ValueError(f"kvcr sidecar: attention CP {storage_config.attn_cp_size} / PP {storage_config.pp_size} "
                             "> 1 is not supported (a sidecar page holds the TP shards of one CP/PP rank)")
        self.storage_config = storage_config
        self.interface_v1 = bool((storage_config.extra_config or {}).get("interface_v1"))
        # One sidecar per DP rank, at the extra-config's ports plus the rank (as the in-process runners)
        self.placement = dp_placement()
        self.endpoint = rank_endpoint("sidecar", self.cfg.sidecar, self.placement.rank, self.placement.size)
        mla = storage_config.is_mla_model
        self.shard, self.shards = (0, 1) if mla else (storage_config.tp_rank, storage_config.tp_size)
        # SGLang calls from several threads; a ZMQ socket serves one: each thread attaches its own.
        self._local = threading.local()
        self._writers: list[AttachedWriter] = []
        self._writers_lock = threading.Lock()
        self.layout: KeyLayout | None = None
        self.mem_pool_host = None
        self.claims = ClaimHolder(self._make_puller)  # its UCX worker is opened on the first claim

    @property
    def writer(self) -> AttachedWriter:
        """This thread's attachment to the sidecar (its control socket and its pool, mapped)."""
        writer = getattr(self._local, "writer", None)  # thread-local: absent until this thread asks
        if writer is None:
            writer = self._local.writer = AttachedWriter(ControlClient(self.endpoint,
                                                                       timeout_s=self.cfg.pull_timeout_s))
            with self._writers_lock:
                self._writers.append(writer)
        return writer

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.layout = KeyLayout(PageLayout.of(mem_pool_host))
        self.chain = AnnounceChain(self.layout.page.page_size)
        self._check_sidecar()

    def _check_sidecar(self) -> None:
        """The sidecar's pool must hold every shard of exactly this engine's pages: refuse naming both."""
        sc, page = self.storage_config, self.layout.page
        pool = self.writer.pools.get(POOL)
        if pool is None:
            raise ValueError(f"kvcr sidecar {self.endpoint} has no pool {POOL!r}")
        if self.writer.info["dp_rank"] != self.placement.rank:
            raise ValueError(f"kvcr sidecar {self.endpoint} serves DP rank {self.writer.info['dp_rank']}, this "
                             f"scheduler is DP rank {self.placement.rank} of {self.placement.size}: start one sidecar "
                             "per rank at the extra-config's port plus the rank, each with its runner.dp_rank")
        # flat (byte-copy) pages order the bytes otherwise: a sidecar holds one or the other
        ours = Namespace(model=sc.model_name or self.cfg.model or "default", tp_size=sc.tp_size, is_mla=sc.is_mla_model,
                         layout=page.layout if self.interface_v1 else f"flat-{page.layout}", dtype=page.dtype,
                         page_size=page.page_size, components=((POOL, page.page_bytes * self.shards),))
        diff = [f"page_bytes: sidecar {pool['page_bytes']}, this rank {page.page_bytes * self.shards}"
                if k == "components" else f"{k}: sidecar {pool['namespace'].get(k)!r}, this rank {v!r}"
                for k, v in ours.fields().items() if pool["namespace"].get(k) != v]
        if diff:
            raise ValueError(f"kvcr sidecar {self.endpoint} does not hold this engine's pages: " + "; ".join(diff))

    # --- lookups -----------------------------------------------------------------------------

    def _held_here(self, keys: list[str]) -> int:
        try:
            tiers = self.writer.client.request(m.Lookup(pool=POOL, keys=list(keys))).tiers
        except (ControlError, TimeoutError) as exc:
            raise LookupFailed(f"sidecar {self.endpoint}: {exc}") from None
        return next((i for i, t in enumerate(tiers) if t == 0), len(keys))

    def _claim_holder(self) -> ClaimHolder | None:
        return self.claims

    def _claim_beyond(self, keys: list[str], local: int, owner: str | None, extra_info) -> int:
        hinted = request_hints(extra_info)
        if hinted is not None and self.cfg.use_request_hints:
            return self._confirm(keys, local, hinted, owner)
        # A hint the router posted to the sidecar: it pulls whole pages (every shard) for all ranks.
        try:
            return local + self.writer.client.request(m.PullRequest(pool=POOL, keys=list(keys[local:]))).num_local
        except (ControlError, TimeoutError) as exc:
            raise LookupFailed(f"sidecar {self.endpoint}: {exc}") from None

    def _confirm(self, keys: list[str], local: int, hinted: HintedRequest, owner: str | None) -> int:
        """Claim keys[local:] at the peer sidecar the request's hint names (this rank's own claim);
        returns how far local pages and the claim reach."""
        source = request_hint_source(hinted, keys[local:], self.layout.page.page_size, self.layout.pages)
        if source is None:
            return local
        endpoint, depth = source
        return self.claims.confirm(endpoint, POOL, keys, local, depth, owner)

    def _make_puller(self) -> Puller:
        from kvcr.drivers.ucx_plane import UcxPlane  # loads libucx: only once a rank pulls

        pool = self.writer.pools[POOL]
        # inline_max 0: a rank reads its slice of each page, and bytes inline would be whole pages
        return Puller(UcxPlane(progress_thread=False), {POOL: pool["namespace"]}, timeout_s=self.cfg.pull_timeout_s,
                      lease_s=self.cfg.claim_lease_s, page_bytes={POOL: pool["page_bytes"]}, transport="auto",
                      inline_max=0)

    def prefetch_ended(self, keys: list[str], request_id: str | None = None) -> None:
        self.claims.prefetch_ended(keys, request_id)

    # --- zero-copy interface -------------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        segments = self.layout.key_segments(self.mem_pool_host, host_indices, len(keys))
        base = self.writer.region.address + self.shard * self.layout.bytes
        n = self._read(keys, lambda i, offset: scatter([(base + offset, segments[i])], self.layout.segment_bytes))
        if n < len(keys) and len(self.claims):
            n += self.claims.deliver(keys, segments, n, self.layout.segment_bytes,
                                      slice_offset=self.shard * self.layout.bytes)
        return [i < n for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        segments = self.layout.key_segments(self.mem_pool_host, host_indices, len(keys))
        announces = self.chain.announces(keys, extra_info.extra_info or {}, extra_info.prefix_keys) \
            if extra_info is not None else None
        base = self.writer.region.address
        ok = self._write(keys, announces, lambda i, at: gather([(segments[i], base + at)], self.layout.segment_bytes))
        return [ok] * len(keys)

    def _read(self, keys: list[str], copy_out: Callable[[int, int], None]) -> int:
        """Copy this rank's slice of the leading pages the sidecar holds (claimed meanwhile);
        returns how many stayed intact for the whole claim."""
        try:
            with self.writer.claimed(POOL, keys) as claim:
                for i, offset in enumerate(claim.offsets):
                    copy_out(i, offset)
        except (ControlError, TimeoutError) as exc:
            log.warning("kvcr sidecar claim failed: %s", exc)
            return 0
        return claim.live

    def _write(self, keys: list[str], announces, copy_in: Callable[[int, int], None]) -> bool:
        """Write this rank's slice into the fill assembling exactly these pages (every rank's)."""
        try:
            with self.writer.filling(POOL, keys, announces, shard=self.shard, lease_s=SHARD_LEASE_S) as fill:
                for i, offset in enumerate(fill.offsets):
                    if offset >= 0:  # -1: present, -2: being written by another fill (counts as stored)
                        copy_in(i, offset + fill.shard_offset)
        except (ControlError, TimeoutError) as exc:
            log.warning("kvcr sidecar refused a backup of %d pages: %s", len(keys), exc)
            return False
        return True

    # --- byte-copy interface (no interface_v1): this rank's slice as one flat tensor ------------

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        keys, size = list(keys), self.layout.bytes
        out: list = [None] * len(keys)
        view = self.writer.view

        def copy_out(i: int, offset: int) -> None:
            target = target_locations[i] if target_locations is not None else torch.empty(size, dtype=torch.uint8)
            start = offset + self.shard * size
            target.view(torch.uint8).reshape(-1).numpy()[:] = view[start:start + size]
            out[i] = target

        n = self._read(keys, copy_out)
        return out[:n] + [None] * (len(keys) - n)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        flats = [v.contiguous().view(torch.uint8).reshape(-1).numpy() for v in values]
        if any(len(f) != self.layout.bytes for f in flats):
            log.warning("kvcr sidecar: flat pages must be %d bytes", self.layout.bytes)
            return False
        view = self.writer.view

        def copy_in(i: int, at: int) -> None:
            view[at:at + len(flats[i])] = flats[i]

        return self._write(list(keys), None, copy_in)

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> None:
        """SGLang's flush: every rank asks, the sidecar drops its pages once (the rest find none)."""
        self.writer.client.request(m.Remove(pool=POOL, everything=True))

    def close(self) -> None:
        self.claims.close(puller=True)
        with self._writers_lock:
            writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()
            writer.client.close()
