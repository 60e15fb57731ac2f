"""Keeping pulled pages after the prefetch returns: a peer's pages land in SGLang's host pages, and
the copy into our own runner (so the next request, and our peers, hit here) runs on one thread
behind the prefetch instead of inside it.

The copy reads host slots SGLang owns. SGLang writes a host slot only after allocating it, and
allocates only slots it freed: a guarded pool's `free` of a slot a queued keep reads (and its
`clear`) first waits for that keep, so the slot cannot be handed out, and so not overwritten,
while the keep reads it. A free of other slots waits for nothing.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from typing import Callable

import torch

log = logging.getLogger(__name__)


class Keeper:
    """Runs jobs in order on one thread; `fence()` returns once every job submitted before it has run."""

    def __init__(self, name: str = "kvcr-keep") -> None:
        self._jobs: deque[Callable[[], None]] = deque()
        self._reads: deque[tuple[int, object, torch.Tensor]] = deque()  # (job number, pool, its slots) queued
        self._cond = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._closed = False
        self._guarded: dict[int, tuple[object, Callable, Callable]] = {}  # id -> pool, its own free and clear
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], reads: tuple[object, torch.Tensor] | None = None) -> None:
        """Queue `job`; `reads`: the host pool and the slot indices it reads (a guarded pool's free
        of any of them waits for it). RuntimeError once closed."""
        slots = reads[1].to("cpu", torch.int64).flatten() if reads is not None else None
        with self._cond:
            if self._closed:
                raise RuntimeError("kvcr: the keeper is closed")
            self._jobs.append(job)
            self._submitted += 1
            if reads is not None:
                self._reads.append((self._submitted, reads[0], slots))
            self._cond.notify_all()

    def fence(self, upto: int | None = None) -> None:
        """Wait until every job submitted so far (or the first `upto`) has run."""
        if threading.current_thread() is self._thread:
            return  # a job waiting on itself would never return
        with self._cond:
            target = self._submitted if upto is None else upto
            self._cond.wait_for(lambda: self._done >= target)

    def fence_slots(self, host_pool: object, indices) -> None:
        """Wait for the queued jobs that read any of `indices` in `host_pool`."""
        with self._cond:
            reads = [(n, slots) for n, pool, slots in self._reads if pool is host_pool and n > self._done]
        if not reads:
            return
        freed = torch.as_tensor(indices).to("cpu", torch.int64).flatten()
        last = max((n for n, slots in reads if bool(torch.isin(freed, slots).any())), default=0)
        if last:
            self.fence(last)

    @property
    def pending(self) -> int:
        with self._cond:
            return self._submitted - self._done

    def guard(self, host_pool: object) -> None:
        """Make the pool's `free` of slots a queued job reads, and its `clear`, wait for those jobs
        (idempotent; `close` puts the pool's own methods back)."""
        if id(host_pool) in self._guarded:
            return
        free, clear = host_pool.free, host_pool.clear

        @functools.wraps(free)
        def fenced_free(indices, *args, **kwargs):
            self.fence_slots(host_pool, indices)
            return free(indices, *args, **kwargs)

        @functools.wraps(clear)
        def fenced_clear(*args, **kwargs):
            self.fence()
            return clear(*args, **kwargs)

        host_pool.free, host_pool.clear = fenced_free, fenced_clear
        self._guarded[id(host_pool)] = (host_pool, free, clear)

    def close(self) -> None:
        """Run what is queued, stop the thread, and give the guarded pools their own methods back."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        for pool, free, clear in self._guarded.values():
            pool.free, pool.clear = free, clear
        self._guarded.clear()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._jobs or self._closed)
                    if not self._jobs:
                        return  # closed and drained
                    job = self._jobs.popleft()
                try:
                    job()
                except Exception:  # a job owns its own cleanup; the thread must outlive one that fails
                    log.exception("kvcr: keeping pulled pages failed")
                with self._cond:
                    self._done += 1
                    while self._reads and self._reads[0][0] <= self._done:
                        self._reads.popleft()
                    self._cond.notify_all()
        finally:
            # However the thread ends, no fence (SGLang's free and clear among them) waits on it.
            with self._cond:
                self._closed = True
                self._jobs.clear()
                self._reads.clear()
                self._done = self._submitted
                self._cond.notify_all()
