"""Bulk page copies between mapped memory: split over threads, streaming stores for whole pages.

Same-host pulls are a memory copy; one core's memcpy is the limit there (see docs/peer.md,
"Same-host copies"). The C helper (`kvcr/_fastcopy.c`, built when a compiler is present)
releases the GIL for a whole batch and writes pages with non-temporal stores; without it each
op is a ctypes.memmove, which releases the GIL too.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Sequence

from ..proto.pull import split_even

try:
    from .. import _fastcopy
except ImportError:  # installed without a C compiler
    _fastcopy = None

STREAM_MIN_BYTES = 64 << 10     # pieces this large bypass the cache (pages, not headers)
PARALLEL_MIN_BYTES = 4 << 20    # below this a thread hand-off costs more than it saves
MAX_THREADS = 64


def default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def copy_serial(ops: Sequence[tuple[int, int, int]], stream_min: int = STREAM_MIN_BYTES) -> None:
    """Copy (dst, nbytes, src) ops in this thread."""
    if _fastcopy is not None:
        _fastcopy.copy(ops, stream_min)
        return
    for dst, n, src in ops:
        ctypes.memmove(dst, src, n)


class Copier:
    """Copies a batch of (dst, nbytes, src) ops, a large batch split evenly over `threads`
    (this one included). Returns only when every byte is written."""

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads or default_threads()
        if not 1 <= self.threads <= MAX_THREADS:
            raise ValueError(f"copy threads = {threads} must be in 1..{MAX_THREADS} (0: one per core, up to 4)")
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvcr-copy") \
            if self.threads > 1 else None

    @property
    def streams(self) -> bool:
        return _fastcopy is not None and bool(_fastcopy.STREAMS)

    def copy(self, ops: Sequence[tuple[int, int, int]]) -> None:
        total = sum(n for _, n, _ in ops)
        if self._pool is None or total < PARALLEL_MIN_BYTES:
            copy_serial(ops)
            return
        shares: list[list[tuple[int, int, int]]] = [[] for _ in range(self.threads)]
        for lane, _, dst, n, src in split_even(list(ops), self.threads):
            shares[lane].append((dst, n, src))
        futures = []
        try:
            for share in shares[1:]:
                if share:
                    futures.append(self._pool.submit(copy_serial, share))
            copy_serial(shares[0])
        finally:
            wait(futures)  # every share is written before we return, even if ours failed
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
