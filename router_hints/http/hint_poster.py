"""Posting a request's source hint to the target worker's runner before the request goes out
(router.post_hints): one thread owns the control sockets, one client per runner."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from kvcr.client import ControlClient, ControlError
from kvcr.proto import messages as m

from ..core import RouterCore
from ..index import Worker
from .metrics import RouterMetrics

log = logging.getLogger(__name__)


class HintPoster:
    def __init__(self, core: RouterCore, metrics: RouterMetrics) -> None:
        self.core = core
        self.metrics = metrics
        self._posting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcr-router-post")  # owns the sockets
        self._clients: dict[str, ControlClient] = {}

    def _post(self, endpoint: str, envelope: dict) -> None:
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = ControlClient(endpoint, timeout_s=2.0)
        try:
            client.request(m.PostHint(envelope=envelope))
        except (TimeoutError, OSError):
            # Its same-host socket belongs to one incarnation of the runner: the next hint reconnects.
            self._clients.pop(endpoint).close()
            raise

    async def post(self, worker: Worker, envelope: dict) -> bool:
        """Whether the worker's runner took the hint."""
        control = self.core.publishers[worker].control
        try:
            await asyncio.get_running_loop().run_in_executor(self._posting, self._post, control, envelope)
            self.metrics.hints.labels("posted").inc()
            return True
        except (TimeoutError, ControlError, OSError) as exc:
            # The request still runs; it computes what a pull would have brought.
            self.metrics.hints.labels("post_failed").inc()
            log.warning("posting a hint to %s failed: %s", control, exc)
            return False

    def close(self) -> None:
        self._posting.submit(lambda: [c.close() for c in self._clients.values()]).result()
        self._posting.shutdown()
