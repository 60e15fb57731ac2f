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
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvcr.client import ControlClient, ControlError
from kvcr.drivers.shm import Region
from kvcr.peer import PeerError, Puller
from kvcr.proto import messages as m
from kvcr.proto.hints import HintError, parse_envelope
from kvcr.proto.keys import U64_MASK, hash_str_to_int64

from . import hooks
from .config import AdapterConfigError, parse_adapter_config
from .layout import KeyLayout, PageLayout, gather, scatter
from .pagemeta import AnnounceChain
from .pending import Pending, PendingClaims

log = logging.getLogger(__name__)
POOL = "kv"
SHARD_LEASE_S = 30.0  # every rank's backup of a batch must land within this, or the pages are dropped


class KVCRSidecarStorage(HiCacheStorage):
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
        mla = storage_config.is_mla_model
        self.shard, self.shards = (0, 1) if mla else (storage_config.tp_rank, storage_config.tp_size)
        self._lock = threading.Lock()  # one socket, one request at a time
        self.client = ControlClient(self.cfg.sidecar, timeout_s=self.cfg.pull_timeout_s)
        self.info = self.client.info()
        self.region = Region.attach(self.info["shm_path"], writable=True)  # mapping is O(1): any pool size
        self.layout: KeyLayout | None = None
        self.mem_pool_host = None
        self._puller: Puller | None = None  # made on the first request hint: a UCX worker of our own
        self._pending = PendingClaims()
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="kvcr-release")

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.layout = KeyLayout(PageLayout.of(mem_pool_host))
        self.chain = AnnounceChain(self.layout.page.page_size)
        self._check_sidecar()

    def _check_sidecar(self) -> None:
        """The sidecar's pool must hold exactly our shards of our model: refuse naming both sides."""
        sc, page = self.storage_config, self.layout.page
        pool = next((p for p in self.info["pools"] if p["name"] == POOL), None)
        if pool is None:
            raise ValueError(f"kvcr sidecar {self.cfg.sidecar} has no pool {POOL!r}")
        ns = pool["namespace"]
        want = {"page_bytes": page.page_bytes * self.shards, "block_size": page.page_size,
                "model": sc.model_name or self.cfg.model or "default", "mla": sc.is_mla_model,
                # flat (byte-copy) pages order the bytes otherwise: a sidecar holds one or the other
                "layout": page.layout if self.interface_v1 else f"flat-{page.layout}", "dtype": page.dtype}
        have = {"page_bytes": pool["page_bytes"], "block_size": self.info["block_size"], "model": ns["model"],
                "mla": ns["mla"], "layout": ns["layout"], "dtype": ns["dtype"]}
        diff = [f"{k}: sidecar {have[k]!r}, this rank {want[k]!r}" for k in want if have[k] != want[k]]
        if diff:
            raise ValueError(f"kvcr sidecar {self.cfg.sidecar} does not hold this engine's pages: " + "; ".join(diff))

    def _request(self, msg: m.Message) -> m.Message:
        with self._lock:
            return self.client.request(msg)

    # --- lookups -----------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        self._give_back(self._pending.expire(time.monotonic(), self.cfg.claim_lease_s))
        try:
            tiers = self._request(m.Lookup(pool=POOL, keys=list(keys))).tiers
            local = next((i for i, t in enumerate(tiers) if t == 0), len(keys))
            if local == len(keys):
                return local
            confirmed = self._pending.covered(keys, local)
            if confirmed > local:
                return confirmed
            raw = (extra_info.extra_info or {}).get("kv_hints") if extra_info is not None else None
            raw = raw if raw is not None else hooks.current_hints()
            if raw is not None and self.cfg.use_request_hints:
                return local + self._confirm(keys, local, raw)
            # A hint the router posted to the sidecar: it pulls whole pages (every shard) for all ranks.
            return local + self._request(m.Pull(pool=POOL, keys=list(keys[local:]))).num_local
        except (ControlError, TimeoutError) as exc:
            log.warning("kvcr sidecar lookup failed: %s", exc)
            return 0

    def _confirm(self, keys: list[str], local: int, raw: object) -> int:
        """Claim keys[local:] at the peer sidecar the request's hint names (this rank's own claim)."""
        try:
            hint = parse_envelope(raw)
        except HintError as exc:
            log.warning("kvcr: request hint ignored: %s", exc)
            return 0
        held = set(hint.block_hashes)
        depth = next((i for i, k in enumerate(keys[local:]) if hash_str_to_int64(k) & U64_MASK not in held),
                     len(keys) - local)
        try:
            conf = self.puller.confirm(hint.source_control_endpoint, POOL, keys[local:local + depth]) \
                if depth else None
        except PeerError as exc:
            log.warning("kvcr: %s", exc)
            return 0
        if conf is None:
            return 0
        self._pending.add(Pending(conf, keys[local:local + conf.num_pages], time.monotonic()))
        return conf.num_pages

    @property
    def puller(self) -> Puller:
        if self._puller is None:
            from kvcr.drivers.ucx_plane import UcxPlane  # loads libucx: only once a rank pulls

            pool = next(p for p in self.info["pools"] if p["name"] == POOL)
            self._puller = Puller(UcxPlane(progress_thread=False), {POOL: pool["namespace"]},
                                  timeout_s=self.cfg.pull_timeout_s, lease_s=self.cfg.claim_lease_s,
                                  page_bytes={POOL: pool["page_bytes"]}, transport="auto")
        return self._puller

    def _give_back(self, pending: list[Pending]) -> None:
        for p in pending:
            self._releaser.submit(self.puller.release, p.conf, wait=False)

    def prefetch_ended(self, keys: list[str]) -> None:
        self._give_back(self._pending.take_starting_in(keys))

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    # --- zero-copy interface -------------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        segments = self.layout.key_segments(self.mem_pool_host, host_indices, len(keys))
        n = self._read_local(keys, segments)
        n += self._pull_slices(keys, segments, n)
        return [i < n for i in range(len(keys))]

    def _read_local(self, keys: list[str], segments: list[list[int]]) -> int:
        """This rank's slice of the leading pages the sidecar holds (claimed while we copy)."""
        try:
            granted = self._request(m.ClaimRequest(pool=POOL, keys=list(keys)))
        except (ControlError, TimeoutError) as exc:
            log.warning("kvcr sidecar claim failed: %s", exc)
            return 0
        if not granted.offsets:
            return 0  # nothing held, nothing claimed
        slice_at = self.shard * self.layout.bytes
        try:
            for offset, segs in zip(granted.offsets, segments):
                scatter(self.region.address + offset + slice_at, segs, self.layout.segment_bytes)
        finally:
            self._request(m.ReleaseRequest(claim_id=granted.claim_id))
        return len(granted.offsets)

    def _pull_slices(self, keys: list[str], segments: list[list[int]], n: int) -> int:
        """GET this rank's slice of what a peer sidecar confirmed, straight into the host pages."""
        delivered = 0
        while n + delivered < len(keys) and (p := self._pending.take(keys, n + delivered)) is not None:
            first = n + delivered
            want = min(len(p.page_hexes), len(keys) - first)
            result = self.puller.deliver(p.conf, segments[first:first + want], segments=self.layout.segment_bytes,
                                         slice_offset=self.shard * self.layout.bytes)
            if result.uncertain:  # a GET may still land in host pages SGLang will reuse
                log.critical("kvcr: a peer transfer into host pages could not be stopped (%s); exiting", result.error)
                os._exit(70)
            delivered += result.delivered
            if result.delivered < want:
                break
        return delivered

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        segments = self.layout.key_segments(self.mem_pool_host, host_indices, len(keys))
        announces = self.chain.announces(keys, extra_info.extra_info or {}, extra_info.prefix_keys) \
            if extra_info is not None else None
        try:
            reply = self._request(m.ReserveShard(pool=POOL, keys=list(keys), shard=self.shard,
                                                 announces=[a.to_wire() for a in announces] if announces else [],
                                                 lease_s=SHARD_LEASE_S))
        except (ControlError, TimeoutError) as exc:
            log.warning("kvcr sidecar refused a backup of %d pages: %s", len(keys), exc)
            return [False] * len(keys)
        ok = True
        try:
            for offset, segs in zip(reply.offsets, segments):
                if offset >= 0:  # -1: present, -2: being written by another fill (counts as stored)
                    gather(segs, self.layout.segment_bytes, self.region.address + offset + reply.shard_offset)
        except BaseException:
            ok = False
            raise
        finally:
            self._request(m.CommitShard(fill_id=reply.fill_id, shard=self.shard, ok=ok))
        return [True] * len(keys)

    # --- byte-copy interface (no interface_v1): this rank's slice as one flat tensor ------------

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        keys = list(keys)
        try:
            granted = self._request(m.ClaimRequest(pool=POOL, keys=keys))
        except (ControlError, TimeoutError) as exc:
            log.warning("kvcr sidecar claim failed: %s", exc)
            return [None] * len(keys)
        out: list = [None] * len(keys)
        if not granted.offsets:
            return out
        size, slice_at = self.layout.bytes, self.shard * self.layout.bytes
        try:
            for i, offset in enumerate(granted.offsets):
                target = target_locations[i] if target_locations is not None else torch.empty(size, dtype=torch.uint8)
                start = offset + slice_at
                target.view(torch.uint8).reshape(-1).numpy()[:] = self.region.view[start:start + size]
                out[i] = target
        finally:
            self._request(m.ReleaseRequest(claim_id=granted.claim_id))
        return out

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        flats = [v.contiguous().view(torch.uint8).reshape(-1).numpy() for v in values]
        if any(len(f) != self.layout.bytes for f in flats):
            log.warning("kvcr sidecar: flat pages must be %d bytes", self.layout.bytes)
            return False
        try:
            reply = self._request(m.ReserveShard(pool=POOL, keys=list(keys), shard=self.shard, lease_s=SHARD_LEASE_S))
        except (ControlError, TimeoutError) as exc:
            log.warning("kvcr sidecar refused a backup of %d pages: %s", len(keys), exc)
            return False
        ok = True
        try:
            for offset, flat in zip(reply.offsets, flats):
                if offset >= 0:
                    start = offset + reply.shard_offset
                    self.region.view[start:start + len(flat)] = flat
        except BaseException:
            ok = False
            raise
        finally:
            self._request(m.CommitShard(fill_id=reply.fill_id, shard=self.shard, ok=ok))
        return True

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> None:
        """SGLang's flush: every rank asks, the sidecar drops its pages once (the rest find none)."""
        self._request(m.Remove(pool=POOL, everything=True))

    def close(self) -> None:
        if self._puller is not None:
            self._give_back(self._pending.drain())
            self._releaser.shutdown(wait=True)
            self._puller.close()
            self._puller.plane.close()
        self.region.close()
        self.client.close()
