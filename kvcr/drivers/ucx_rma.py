"""One-sided UCX GET for Python: the few libucp RMA calls ucxx's Python API does not expose.

ucxx hands out the raw `ucp_context_h`, `ucp_worker_h` and `ucp_ep_h` handles; this module calls
libucp (from the pinned `libucx-cu12` wheel) on them through ctypes. Only calls whose parameter
structs we fill are bound, and only the leading struct fields are used (field masks select
them), so the layout we rely on is the one `tests/test_ucx_rma.py` checks against the shipped
`ucp.h`. Any other UCX version is refused at import, by name.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path

TESTED_UCX = (1, 21)

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_LAST = -100
MEM_MAP_FIELD_ADDRESS = 1 << 0
MEM_MAP_FIELD_LENGTH = 1 << 1
MEM_MAP_FIELD_PROT = 1 << 3
PROT_LOCAL_READ, PROT_LOCAL_WRITE, PROT_REMOTE_READ = 1 << 0, 1 << 1, 1 << 8
# Peers may read our region, never write it. UCX enforces this on RDMA verbs only (TCP and shared
# memory transports copy regardless): page digests catch what is changed anyway (docs/security.md).
REGION_PROT = PROT_LOCAL_READ | PROT_LOCAL_WRITE | PROT_REMOTE_READ
ALL_TAG_BITS = (1 << 64) - 1  # a tagged receive matches its tag exactly
REQUEST_PARAM_BYTES = 256  # >= sizeof(ucp_request_param_t); op_attr_mask 0 means "read nothing else"


class UcxError(RuntimeError):
    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what}: UCX status {status}")
        self.status = status


class UcxVersionError(RuntimeError):
    pass


class _MemMapParams(ctypes.Structure):
    # Leading fields of ucp_mem_map_params_t; the rest stays zero (not in field_mask).
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p), ("length", ctypes.c_size_t),
                ("flags", ctypes.c_uint), ("prot", ctypes.c_uint), ("_rest", ctypes.c_uint8 * 64)]


def _load() -> ctypes.CDLL:
    import libucx  # the wheel ucxx links against

    libucx.load_library()
    lib = ctypes.CDLL(str(Path(libucx.__file__).parent / "lib" / "libucp.so"), mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL
                      if hasattr(os, "RTLD_NOLOAD") else ctypes.RTLD_GLOBAL)
    vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint  # ucs_status_t is a packed enum: int8
    signatures = {
        "ucp_get_version": (None, [ctypes.POINTER(u)] * 3),
        "ucp_mem_map": (ctypes.c_int8, [vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(vp)]),
        "ucp_mem_unmap": (ctypes.c_int8, [vp, vp]),
        "ucp_rkey_pack": (ctypes.c_int8, [vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)]),
        "ucp_rkey_buffer_release": (None, [vp]),
        "ucp_ep_rkey_unpack": (ctypes.c_int8, [vp, vp, ctypes.POINTER(vp)]),
        "ucp_rkey_destroy": (None, [vp]),
        "ucp_get_nbx": (vp, [vp, vp, sz, ctypes.c_uint64, vp, vp]),
        "ucp_ep_flush_nbx": (vp, [vp, vp]),
        "ucp_tag_recv_nbx": (vp, [vp, vp, sz, ctypes.c_uint64, ctypes.c_uint64, vp]),
        "ucp_worker_progress": (u, [vp]),
        "ucp_request_check_status": (ctypes.c_int8, [vp]),
        "ucp_request_cancel": (None, [vp, vp]),
        "ucp_request_free": (None, [vp]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


_lib = _load()


def ucx_version() -> tuple[int, int, int]:
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    _lib.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    return major.value, minor.value, release.value


def check_version() -> tuple[int, int, int]:
    version = ucx_version()
    if version[:2] != TESTED_UCX:
        raise UcxVersionError(f"UCX {'.'.join(map(str, version))} is loaded, but kvcr's RMA binding is tested "
                              f"with UCX {'.'.join(map(str, TESTED_UCX))} only (libucx-cu12==1.21.0): "
                              "struct layouts differ between versions")
    return version


check_version()
_NO_PARAMS = ctypes.create_string_buffer(REQUEST_PARAM_BYTES)  # op_attr_mask = 0


def progress_worker(worker: int) -> int:
    """One progress call. With nothing done, the CPU is given away: a same-host GET completes
    only once the source's progress thread runs, and on a small host it may wait for our core."""
    events = _lib.ucp_worker_progress(worker)
    if not events:
        os.sched_yield()
    return events


def _status_of(ptr: int | None) -> tuple[int, int | None]:
    """(status, request) from a ucs_status_ptr_t: NULL = done, small negative = error, else a request."""
    if not ptr:
        return UCS_OK, None
    signed = ctypes.c_ssize_t(ptr).value
    if UCS_ERR_LAST <= signed < 0:
        return signed, None
    return UCS_INPROGRESS, ptr


@dataclass
class MemoryRegistration:
    """A region registered with a UCX context, and the packed remote key peers need to read it."""

    context: int
    memh: int
    address: int
    length: int
    rkey: bytes

    @classmethod
    def register(cls, context: int, address: int, length: int) -> "MemoryRegistration":
        params = _MemMapParams(field_mask=MEM_MAP_FIELD_ADDRESS | MEM_MAP_FIELD_LENGTH | MEM_MAP_FIELD_PROT,
                               address=address, length=length, prot=REGION_PROT)
        memh = ctypes.c_void_p()
        status = _lib.ucp_mem_map(context, ctypes.byref(params), ctypes.byref(memh))
        if status != UCS_OK:
            raise UcxError(f"ucp_mem_map of {length} bytes", status)
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        status = _lib.ucp_rkey_pack(context, memh, ctypes.byref(buf), ctypes.byref(size))
        if status != UCS_OK:
            _lib.ucp_mem_unmap(context, memh)
            raise UcxError("ucp_rkey_pack", status)
        rkey = ctypes.string_at(buf, size.value)
        _lib.ucp_rkey_buffer_release(buf)
        return cls(context, memh.value, address, length, rkey)

    def unregister(self) -> None:
        if self.memh:
            _lib.ucp_mem_unmap(self.context, self.memh)
            self.memh = 0


class RemoteKey:
    """A peer's packed rkey, unpacked for one endpoint."""

    def __init__(self, ep: int, packed: bytes) -> None:
        handle = ctypes.c_void_p()
        status = _lib.ucp_ep_rkey_unpack(ep, packed, ctypes.byref(handle))
        if status != UCS_OK:
            raise UcxError("ucp_ep_rkey_unpack", status)
        self.handle = handle.value

    def destroy(self) -> None:
        if self.handle:
            _lib.ucp_rkey_destroy(self.handle)
            self.handle = 0


@dataclass(frozen=True, slots=True)
class GetResult:
    """Per GET: True if its bytes arrived. `uncertain`: some buffer may still be written later.
    `outstanding`: requests still running at the deadline (handles for `settle`; none once settled)."""

    done: tuple[bool, ...]
    uncertain: bool = False
    error: str = ""
    outstanding: tuple[int, ...] = ()


def get_batch(worker: int, ep: int, rkey: RemoteKey, ops: list[tuple[int, int, int]], *, timeout_s: float,
              progress=None, alive=lambda: True) -> GetResult:
    """Post one GET per (local_address, nbytes, remote_address), flush, and wait up to `timeout_s`.

    Returns per GET whether it completed. Requests still running at the deadline come back in
    `outstanding`, unfreed: UCX cannot cancel an RMA request, so the caller must end them (force-
    close the endpoint, then `settle`) before the buffers may be reused.
    """
    progress = progress or (lambda: progress_worker(worker))
    pending: dict[int, int] = {}
    done = [False] * len(ops)
    error = ""
    for i, (local, nbytes, remote) in enumerate(ops):
        if not alive():
            error = "endpoint closed"
            break
        status, request = _status_of(_lib.ucp_get_nbx(ep, local, nbytes, remote, rkey.handle, _NO_PARAMS))
        if request is not None:
            pending[i] = request
        elif status == UCS_OK:
            done[i] = True
        else:
            error = error or f"ucp_get_nbx failed with status {status}"
            break
    flush_status, flush = _status_of(_lib.ucp_ep_flush_nbx(ep, _NO_PARAMS) if alive() else None)
    flush_ok = flush is not None or (flush_status == UCS_OK and alive())
    if not flush_ok:
        error = error or f"ucp_ep_flush_nbx failed with status {flush_status}"
    deadline = time.monotonic() + timeout_s
    while pending or flush is not None:
        progress()
        if flush is not None:
            status = _finished(flush)
            if status is not None:
                flush = None
                if status != UCS_OK:
                    flush_ok = False
                    error = error or f"flush failed with status {status}"
        # GETs end about in order: while the flush runs, look only up to the first unfinished one
        # (a full scan per progress call made a batch quadratic); once it ended, look at all.
        timed_out = time.monotonic() >= deadline
        error = _collect(pending, done, error, every=flush is None or timed_out)
        if timed_out and (pending or flush is not None):
            # GETs that completed hold their bytes for good; the rest are the caller's to end.
            return GetResult(tuple(done), error=error or f"transfer timed out after {timeout_s} s",
                             outstanding=(*pending.values(), *([flush] if flush is not None else [])))
    if not flush_ok:  # a failed flush means no GET can be trusted, whatever its own status said
        done = [False] * len(done)
    return GetResult(tuple(done), error=error)


def _collect(pending: dict[int, int], done: list[bool], error: str, *, every: bool) -> str:
    """Record and free the finished requests in `pending` (op index -> request), in posting order;
    unless `every`, stop at the first one still running. Returns the first error seen."""
    ended = []
    for i, request in pending.items():
        status = _finished(request)
        if status is None:
            if every:
                continue
            break
        ended.append(i)
        done[i] = status == UCS_OK
        error = error or ("" if status == UCS_OK else f"GET failed with status {status}")
    for i in ended:
        del pending[i]
    return error


def recv_batch(worker: int, ops: list[tuple[int, int, int]], source_answer, *, timeout_s: float,
               abandon_s: float) -> GetResult:
    """Post a tagged receive per (local_address, nbytes, tag) and progress until they complete.
    `source_answer()` polls the sender's reply: None while pending, False if it will send nothing
    (then we stop at once). At the deadline unmatched receives are cancelled; one already
    receiving cannot be: it comes back in `outstanding` (`uncertain`) for the caller to end."""
    pending: dict[int, int] = {}
    done = [False] * len(ops)
    for i, (local, nbytes, tag) in enumerate(ops):
        status, request = _status_of(_lib.ucp_tag_recv_nbx(worker, local, nbytes, tag, ALL_TAG_BITS, _NO_PARAMS))
        if request is not None:
            pending[i] = request
        else:
            done[i] = status == UCS_OK
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        progress_worker(worker)
        _collect(pending, done, "", every=False)  # the source sends in order: they end in order
        if pending and source_answer() is False:
            break
    if not pending:
        return GetResult(tuple(done), error="" if all(done) else "tagged transfer failed")
    for request in pending.values():
        _lib.ucp_request_cancel(worker, request)
    outstanding = tuple(pending.values())
    if settle(worker, outstanding, abandon_s):
        return GetResult((False,) * len(done), error="tagged transfer failed, timed out or was refused")
    return GetResult((False,) * len(done), uncertain=True, outstanding=outstanding,
                     error="tagged receives still outstanding after cancel")


def _finished(request: int) -> int | None:
    """The request's final status, freeing it; None while it runs."""
    status = _lib.ucp_request_check_status(request)
    if status == UCS_INPROGRESS:
        return None
    _lib.ucp_request_free(request)
    return status


def settle(worker: int, requests: tuple[int, ...], timeout_s: float) -> bool:
    """Progress `worker` until every request finished (freeing each); False if some still run.
    After a forced endpoint close UCX completes them with an error at the next progress."""
    left = list(requests)
    deadline = time.monotonic() + timeout_s
    while left:
        progress_worker(worker)
        left = [r for r in left if _finished(r) is None]
        if left and time.monotonic() >= deadline:
            return False
    return True
