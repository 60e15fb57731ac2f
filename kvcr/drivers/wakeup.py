"""Wakes a thread blocked in `zmq.Poller.poll` from any other thread.

The waker is an eventfd registered in the poll set next to the sockets, so a reply or a batch
queued by another thread goes out at once, without the loop polling on a short timeout.
"""

from __future__ import annotations

import contextlib
import os
import threading


class Waker:
    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # what the poller registers; -1 once closed
        self._lock = threading.Lock()  # a wake racing close() must not write to a reused fd number

    def wake(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        """Called by the woken thread before it looks at what it was woken for."""
        with self._lock, contextlib.suppress(BlockingIOError):
            if self.fd >= 0:
                os.eventfd_read(self.fd)

    def close(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
