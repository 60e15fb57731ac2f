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
from dataclasses import dataclass

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

from .ucx_rma import GetResult, MemoryRegistration, RemoteKey, get_batch, progress_worker  # noqa: E402

log = logging.getLogger(__name__)
REGISTRATION_CHUNK = 1 << 30


def _array(address: int, nbytes: int) -> Array:
    return Array((ctypes.c_char * nbytes).from_address(address))


@dataclass(frozen=True, slots=True)
class RegisteredChunk:
    offset: int   # within the region
    length: int
    rkey: bytes


class UcxPlane:
    def __init__(self, *, progress_thread: bool = True) -> None:
        self.context = ucx.UCXContext()
        self.worker = ucx.UCXWorker(self.context)  # serves our region to peers
        self.address = self.worker.address.tobytes()
        # Our GETs use their own worker, progressed only by the pulling thread: a peer's failure is
        # then handled inside our own progress calls, never under our feet by another thread.
        self.pull_worker = ucx.UCXWorker(self.context)
        self.pull_address = self.pull_worker.address.tobytes()
        self._send_endpoints: dict[bytes, object] = {}
        self.num_leaked_rkeys = 0
        self._lock = threading.Lock()  # one thread progresses the worker during a pull
        self._registrations: list[MemoryRegistration] = []
        self.chunks: list[RegisteredChunk] = []
        self.registered_bytes = 0
        self.registration_seconds = 0.0
        self.registration_done = threading.Event()
        self._endpoints: dict[bytes, tuple[object, dict[bytes, RemoteKey]]] = {}
        if progress_thread:  # a TCP GET is served by the owner's worker, so the source must progress
            self.worker.init_blocking_progress_mode()
            self.worker.start_progress_thread(False)

    # --- source side -----------------------------------------------------------------------------

    def register_region(self, base: int, length: int, chunk: int = REGISTRATION_CHUNK) -> threading.Thread:
        """Register [base, base + length) in chunks on a background thread."""
        def run() -> None:
            t0 = time.perf_counter()
            try:
                for offset in range(0, length, chunk):
                    size = min(chunk, length - offset)
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

    def registered(self, offset: int, length: int) -> bool:
        return any(c.offset <= offset and offset + length <= c.offset + c.length for c in self.chunks)

    def info(self) -> dict:
        return {"address": self.address.hex(), "registered_bytes": self.registered_bytes,
                "chunks": [[c.offset, c.length] for c in self.chunks]}

    # --- destination side -------------------------------------------------------------------------

    def get(self, peer_address: bytes, rkeys: dict[int, bytes], remote_base: int, ops: list[tuple[int, int, int]],
            *, timeout_s: float, abandon_s: float) -> GetResult:
        """GETs of (local_address, nbytes, remote_offset), each inside one registered chunk of the
        peer (`rkeys` maps chunk offset -> packed rkey)."""
        with self._lock:
            ep, unpacked = self._endpoint(peer_address)
            starts = sorted(rkeys)
            done: list[bool] = []
            uncertain, error = False, ""
            groups: dict[int, list[tuple[int, int, int]]] = {}
            order: list[tuple[int, int]] = []
            for local, nbytes, remote_offset in ops:
                chunk = max(s for s in starts if s <= remote_offset)
                groups.setdefault(chunk, []).append((local, nbytes, remote_base + remote_offset))
                order.append((chunk, len(groups[chunk]) - 1))
            results = {}
            for chunk, chunk_ops in groups.items():
                key = unpacked.get(rkeys[chunk])
                if key is None:
                    key = unpacked[rkeys[chunk]] = RemoteKey(ep.handle, rkeys[chunk])
                results[chunk] = get_batch(self.pull_worker.handle, ep.handle, key, chunk_ops, timeout_s=timeout_s,
                                           abandon_s=abandon_s, alive=lambda: ep.alive)
                uncertain = uncertain or results[chunk].uncertain
                error = error or results[chunk].error
            done = [results[chunk].done[i] for chunk, i in order]
            if error:
                self._forget(peer_address)  # a failed peer gets a fresh endpoint next time
            return GetResult(tuple(done), uncertain, error)

    # --- two-sided fallback: tagged sends into buffers the destination posted -------------------

    def send_tagged(self, peer_address: bytes, ops: list[tuple[int, int, int]], timeout_s: float) -> list[bool]:
        """Source side: tag-send (address, nbytes, tag) to a puller's worker; True per completed send."""
        with self._lock:
            ep = self._send_endpoints.get(peer_address)
            if ep is None:
                ep = self._send_endpoints[peer_address] = self.worker.create_endpoint_from_worker_address(
                    ucx.UCXAddress.create_from_buffer(peer_address), True)
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
        with self._lock:
            requests = [self.pull_worker.tag_recv(_array(addr, n), ucx.UCXXTag(tag)) for addr, n, tag in ops]
            deadline = time.monotonic() + timeout_s
            cancelled = False
            while not all(r.completed for r in requests):
                self.pull_worker.progress()
                if source_answer() is False and not cancelled:
                    deadline = time.monotonic()
                if time.monotonic() >= deadline:
                    if cancelled:
                        return GetResult(tuple(r.completed and r.status == 0 for r in requests), uncertain=True,
                                         error="tagged receives still outstanding after cancel")
                    self.pull_worker.cancel_inflight_requests()
                    cancelled, deadline = True, time.monotonic() + abandon_s
            done = tuple(r.status == 0 for r in requests)
            return GetResult(done, error="" if all(done) else "tagged transfer failed or was cancelled")

    def _endpoint(self, peer_address: bytes):
        entry = self._endpoints.get(peer_address)
        if entry is None:
            ep = self.pull_worker.create_endpoint_from_worker_address(
                ucx.UCXAddress.create_from_buffer(peer_address), True)
            entry = self._endpoints[peer_address] = (ep, {})
        return entry

    def _forget(self, peer_address: bytes) -> None:
        entry = self._endpoints.pop(peer_address, None)
        if entry is None:
            return
        ep, keys = entry
        if ep.alive:
            for key in keys.values():
                key.destroy()
        else:  # UCX already tore the endpoint down on the peer's failure: its rkeys must not be touched
            self.num_leaked_rkeys += len(keys)
        try:
            ep.close_blocking(100_000_000, 10)  # period ns, attempts: we own this worker's progress
        except Exception:  # closing a dead peer's endpoint may itself fail; it is gone either way
            log.debug("closing endpoint failed", exc_info=True)

    def close(self) -> None:
        for peer in list(self._endpoints):
            self._forget(peer)
        for ep in self._send_endpoints.values():
            try:
                ep.close_blocking(100_000_000, 10)
            except Exception:
                log.debug("closing a send endpoint failed", exc_info=True)
        self._send_endpoints.clear()
        try:
            self.worker.stop_progress_thread()
        except Exception:
            log.debug("stopping the UCX progress thread failed", exc_info=True)
        with self._lock:
            for reg in self._registrations:
                reg.unregister()
            self._registrations.clear()
