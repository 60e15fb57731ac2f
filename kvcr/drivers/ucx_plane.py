"""The UCX data plane: a context and worker per process, the DRAM region registered for peers,
and one-sided GETs from peers into local buffers.

Registration of a large region runs in chunks on a background thread, so a runner serves local
work at once and peers as soon as the chunk holding a page is registered.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

# UCX reads its environment when the context is created. These defaults work on one host (shared
# memory) and across hosts (TCP); an operator's own UCX_* settings win.
UCX_DEFAULTS = {
    "UCX_TLS": "sm,tcp",
    "UCX_POSIX_ERROR_HANDLING": "y",
    "UCX_SYSV_ERROR_HANDLING": "y",
    "UCX_TCP_TX_SEG_SIZE": "256k",
    "UCX_TCP_RX_SEG_SIZE": "256k",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
for _key, _value in UCX_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

import ucxx._lib.libucxx as ucx  # noqa: E402  (after the environment is set)
from ucxx._lib.arr import Array  # noqa: E402

from ..proto.pull import pages_inside, split_even  # noqa: E402
from .ucx_rma import GetResult, MemoryRegistration, RemoteKey, get_batch, progress_worker, recv_batch, settle  # noqa: E402

log = logging.getLogger(__name__)
REGISTRATION_CHUNK = 1 << 30
PARALLEL_MIN_BYTES = 8 << 20
MAX_SEND_ENDPOINTS = 256  # smaller transfers stay on one lane: a thread hand-off costs more


def _close_quietly(ep) -> None:
    try:
        ep.close_blocking(100_000_000, 10)
    except Exception:  # a dead peer's endpoint may fail to close; it is gone either way
        log.debug("closing an endpoint failed", exc_info=True)


def _array(address: int, nbytes: int) -> Array:
    return Array((ctypes.c_char * nbytes).from_address(address))


class _Lane:
    """A worker used only for our GETs, its endpoints to peers and their unpacked keys."""

    def __init__(self, context) -> None:
        self.context = context
        self.worker = ucx.UCXWorker(context)
        self.lock = threading.Lock()
        self.endpoints: dict[bytes, tuple[object, dict[bytes, RemoteKey]]] = {}
        self.num_retired = 0

    def endpoint(self, peer_address: bytes):
        entry = self.endpoints.get(peer_address)
        if entry is None:
            ep = self.worker.create_endpoint_from_worker_address(ucx.UCXAddress.create_from_buffer(peer_address),
                                                                 True)
            entry = self.endpoints[peer_address] = (ep, {})
        return entry

    def forget(self, peer_address: bytes) -> int:
        """Drop the endpoint; returns rkeys that could not be destroyed (UCX tore the endpoint down)."""
        entry = self.endpoints.pop(peer_address, None)
        if entry is None:
            return 0
        ep, keys = entry
        leaked = 0
        if ep.alive:
            for key in keys.values():
                key.destroy()
        else:
            leaked = len(keys)
        try:
            ep.close_blocking(100_000_000, 10)  # period ns, attempts: we own this worker's progress
        except Exception:  # closing a dead peer's endpoint may itself fail; it is gone either way
            log.debug("closing endpoint failed", exc_info=True)
        return leaked

    def stop(self, peer_address: bytes, outstanding: tuple[int, ...], abandon_s: float) -> int:
        """End GETs still running at their deadline: force-close their endpoint (UCX then fails
        them) and wait for each, then retire the worker. Returns rkeys that could not be destroyed."""
        leaked = self.forget(peer_address)  # a forced close: error handling is on for our endpoints
        if not settle(self.worker.handle, outstanding, abandon_s):
            log.warning("%d GETs outlived their endpoint; destroying their worker ends them", len(outstanding))
        return leaked + self.retire()

    def retire(self) -> int:
        """Destroy the worker and start over on a new one: a worker whose peer died mid-transfer
        stalls every later request, to any peer, and destroying it ends whatever still ran on it
        (no byte lands after). The caller must hold no endpoint of it. Returns rkeys leaked."""
        leaked = sum(self.forget(peer) for peer in list(self.endpoints))
        self.worker = ucx.UCXWorker(self.context)  # the old one goes with its last reference
        self.num_retired += 1
        return leaked


@dataclass(frozen=True, slots=True)
class RegisteredChunk:
    offset: int   # within the region
    length: int
    rkey: bytes


class UcxPlane:
    def __init__(self, *, progress_thread: bool = True, lanes: int = 1, interface: str = "") -> None:
        if interface:  # read when the context is created: UCX then listens and connects on it alone
            os.environ["UCX_NET_DEVICES"] = interface
        self.context = ucx.UCXContext()
        self.worker = ucx.UCXWorker(self.context)  # serves our region to peers
        self.address = self.worker.address.tobytes()
        # Our GETs use their own workers ("lanes"), each progressed only by the thread pulling on it:
        # a peer's failure is handled inside our own progress calls, never under our feet.
        self._lanes = [_Lane(self.context) for _ in range(lanes)]
        self._lane_pool = ThreadPoolExecutor(max(1, lanes - 1), thread_name_prefix="kvcr-ucx-lane")
        self._send_endpoints: OrderedDict[bytes, object] = OrderedDict()
        self.num_leaked_rkeys = 0
        self._lock = threading.Lock()  # one thread progresses the worker during a pull
        self._registrations: list[MemoryRegistration] = []
        self.chunks: list[RegisteredChunk] = []
        self.registered_bytes = 0
        self.registration_seconds = 0.0
        self.registration_done = threading.Event()
        if progress_thread:  # a TCP GET is served by the owner's worker, so the source must progress
            self.worker.init_blocking_progress_mode()
            self.worker.start_progress_thread(False)

    # --- source side -----------------------------------------------------------------------------

    def register_region(self, base: int, length: int, chunk: int = REGISTRATION_CHUNK,
                        ranges: list[tuple[int, int, int]] | None = None) -> threading.Thread:
        """Register the region in chunks on a background thread. `ranges` ((offset, length, stride)
        per pool) cut chunks on page boundaries, so no page straddles two registrations."""
        pieces = []
        for offset, size, stride in ranges or [(0, length, 1)]:
            step = max(stride, chunk // stride * stride)
            pieces += [(offset + o, min(step, size - o)) for o in range(0, size, step)]

        def run() -> None:
            t0 = time.perf_counter()
            try:
                for offset, size in pieces:
                    reg = MemoryRegistration.register(self.context.handle, base + offset, size)
                    with self._lock:
                        self._registrations.append(reg)
                        self.chunks.append(RegisteredChunk(offset, size, reg.rkey))
                        self.registered_bytes += size
            except Exception:
                log.exception("UCX registration of the DRAM region failed; peers cannot pull")
            finally:
                self.registration_seconds = time.perf_counter() - t0
                self.registration_done.set()

        thread = threading.Thread(target=run, name="kvcr-ucx-register", daemon=True)
        thread.start()
        return thread

    def registered(self, offsets: Sequence[int], length: int) -> bool:
        """Whether every page (`length` bytes at each offset) lies in a registered chunk."""
        return pages_inside(offsets, length, [(c.offset, c.length) for c in self.chunks])

    def info(self) -> dict:
        return {"address": self.address.hex(), "registered_bytes": self.registered_bytes,
                "chunks": [[c.offset, c.length] for c in self.chunks]}

    # --- destination side -------------------------------------------------------------------------

    @property
    def pull_address(self) -> bytes:
        """Where a source sends tagged pages: the first lane's worker (it changes when retired)."""
        return self._lanes[0].worker.address.tobytes()

    @property
    def num_retired_workers(self) -> int:
        return sum(lane.num_retired for lane in self._lanes)

    def get(self, peer_address: bytes, rkeys: dict[int, bytes], remote_base: int, ops: list[tuple[int, int, int]],
            *, timeout_s: float, abandon_s: float) -> GetResult:
        """GETs of (local_address, nbytes, remote_offset), each inside one registered chunk of the
        peer (`rkeys` maps chunk offset -> packed rkey). Large transfers are split over the lanes
        (one worker and thread each): over shared memory the copy runs in the caller's CPU."""
        if not ops:
            return GetResult(())
        if not rkeys:
            return GetResult((False,) * len(ops), error="the peer has no registered memory yet")
        pieces = split_even(ops, len(self._lanes) if sum(n for _, n, _ in ops) >= PARALLEL_MIN_BYTES else 1)
        jobs = [(lane, [p for p in pieces if p[0] == i]) for i, lane in enumerate(self._lanes)]
        jobs = [(lane, mine) for lane, mine in jobs if mine]
        futures = [self._lane_pool.submit(self._lane_get, lane, peer_address, rkeys, remote_base, mine,
                                          timeout_s, abandon_s) for lane, mine in jobs[1:]]
        lane, mine = jobs[0]  # the first share runs in this thread
        results = [self._lane_get(lane, peer_address, rkeys, remote_base, mine, timeout_s, abandon_s)]
        results += [f.result() for f in futures]  # every lane finishes before we answer
        done = [True] * len(ops)
        for (_, mine), result in zip(jobs, results):
            for (_, op_index, *_), ok in zip(mine, result.done):
                done[op_index] = done[op_index] and ok
        error = next((r.error for r in results if r.error), "")
        return GetResult(tuple(done), any(r.uncertain for r in results), error)

    def _lane_get(self, lane: "_Lane", *args) -> GetResult:
        """A lane's GETs. After an unexpected failure nothing proves they stopped: the lane's worker
        is destroyed, which ends them."""
        pieces = args[3]
        try:
            return self._get_on_lane(lane, *args)
        except Exception as exc:
            log.exception("GETs on a lane failed")
            with lane.lock:
                self.num_leaked_rkeys += lane.retire()
            return GetResult((False,) * len(pieces), error=f"{type(exc).__name__}: {exc}")

    def _get_on_lane(self, lane: "_Lane", peer_address: bytes, rkeys: dict[int, bytes], remote_base: int,
                     pieces: list[tuple[int, int, int, int, int]], timeout_s: float, abandon_s: float) -> GetResult:
        with lane.lock:
            starts = sorted(rkeys)
            groups: dict[int, list[tuple[int, int, int]]] = {}
            order: list[tuple[int, int]] = []
            for _, _, local, nbytes, remote_offset in pieces:
                chunk = max(s for s in starts if s <= remote_offset)
                groups.setdefault(chunk, []).append((local, nbytes, remote_base + remote_offset))
                order.append((chunk, len(groups[chunk]) - 1))
            try:  # nothing is posted yet: a failure here leaves no GET in flight
                ep, unpacked = lane.endpoint(peer_address)
                keys = {chunk: unpacked.get(rkeys[chunk]) or unpacked.setdefault(
                    rkeys[chunk], RemoteKey(ep.handle, rkeys[chunk])) for chunk in groups}
            except Exception as exc:
                self.num_leaked_rkeys += lane.forget(peer_address)
                return GetResult((False,) * len(pieces), error=f"cannot reach the peer: {type(exc).__name__}: {exc}")
            results = {chunk: get_batch(lane.worker.handle, ep.handle, keys[chunk], chunk_ops, timeout_s=timeout_s,
                                        alive=lambda: ep.alive) for chunk, chunk_ops in groups.items()}
            error = next((r.error for r in results.values() if r.error), "")
            outstanding = tuple(q for r in results.values() for q in r.outstanding)
            if outstanding:
                ep = None  # our last reference to the endpoint: retiring destroys its worker
                self.num_leaked_rkeys += lane.stop(peer_address, outstanding, abandon_s)
            elif error:
                self.num_leaked_rkeys += lane.forget(peer_address)  # a failed peer gets a fresh endpoint
            return GetResult(tuple(results[chunk].done[i] for chunk, i in order), error=error)

    # --- two-sided fallback: tagged sends into buffers the destination posted -------------------

    def send_tagged(self, peer_address: bytes, ops: list[tuple[int, int, int]], timeout_s: float) -> list[bool]:
        """Source side: tag-send (address, nbytes, tag) to a puller's worker; True per completed send."""
        with self._lock:
            ep = self._send_endpoints.pop(peer_address, None)
            if ep is None:
                if len(self._send_endpoints) >= MAX_SEND_ENDPOINTS:  # oldest peer out
                    _, old = self._send_endpoints.popitem(last=False)
                    _close_quietly(old)
                ep = self.worker.create_endpoint_from_worker_address(ucx.UCXAddress.create_from_buffer(peer_address),
                                                                     True)
            self._send_endpoints[peer_address] = ep  # most recently used last
            requests = [ep.tag_send(_array(addr, n), ucx.UCXXTag(tag)) for addr, n, tag in ops]
        deadline = time.monotonic() + timeout_s
        while not all(r.completed for r in requests) and time.monotonic() < deadline:
            # The blocking-mode progress thread sleeps until an fd wakes it, and shared-memory
            # lanes raise none: drive the worker ourselves (it is created thread-safe).
            progress_worker(self.worker.handle)
        return [r.completed and r.status == 0 for r in requests]

    def receive_tagged(self, ops: list[tuple[int, int, int]], source_answer, *, timeout_s: float,
                       abandon_s: float) -> GetResult:
        """Destination side: post a receive per (local address, nbytes, tag), then progress until
        they complete. `source_answer()` polls the source's reply to our send request: None while
        pending, True once it sent, False if it refused (then nothing will come: cancel at once)."""
        lane = self._lanes[0]
        with lane.lock:
            try:
                result = recv_batch(lane.worker.handle, ops, source_answer, timeout_s=timeout_s, abandon_s=abandon_s)
            except Exception as exc:  # receives may be posted: destroying the worker ends them
                log.exception("tagged receives failed")
                self.num_leaked_rkeys += lane.retire()
                return GetResult((False,) * len(ops), error=f"{type(exc).__name__}: {exc}")
            if not all(result.done):  # a sender that stalled or died may have wedged this worker
                self.num_leaked_rkeys += lane.retire()  # and receives it could not cancel end with it
            return GetResult(result.done, error=result.error)

    def close(self) -> None:
        for lane in self._lanes:
            for peer in list(lane.endpoints):
                self.num_leaked_rkeys += lane.forget(peer)
        self._lane_pool.shutdown(wait=True)
        for ep in self._send_endpoints.values():
            _close_quietly(ep)
        self._send_endpoints.clear()
        try:
            self.worker.stop_progress_thread()
        except Exception:
            log.debug("stopping the UCX progress thread failed", exc_info=True)
        with self._lock:
            for reg in self._registrations:
                reg.unregister()
            self._registrations.clear()
