"""Probes sources that stopped answering, off the request path, so one that comes back is asked
again within a probe interval instead of after its whole back-off.

I/O only: which endpoints to probe, and when, is `kvcr.proto.reach.Reachability`'s. A probe is an
info request on a fresh socket; every due endpoint is probed at once, so a dead one never delays
another's answer.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..client import ControlClient
from ..config import CurveKeys
from ..proto import messages as m
from ..proto.reach import Reachability

log = logging.getLogger(__name__)


class Prober:
    def __init__(self, reach: Reachability, lock: threading.Lock, *, timeout_s: float, curve: CurveKeys | None,
                 on_answer: Callable[[str, dict], None]) -> None:
        """`lock` guards `reach` (the puller's request threads use it too). `on_answer(endpoint,
        info)` runs on the prober's thread after a back-off ended."""
        self._reach, self._lock = reach, lock
        self._timeout_s, self._curve, self._on_answer = timeout_s, curve, on_answer
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()

    def wake(self) -> None:
        """A source just went down: (re)schedule. Starts the thread on first use."""
        if self._closed:
            return
        with self._starting:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvcr-reach-probe", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            try:
                with self._lock:
                    due = self._reach.probes_due(time.monotonic())
                if due:
                    self._probe(due)
            except Exception:  # one bad round (no sockets left, say) must not end recovery for every source
                log.exception("probing down sources failed; trying again at the next interval")
            with self._lock:
                next_at = self._reach.next_probe_at(time.monotonic())
            self._wake.wait(None if next_at is None else max(0.0, next_at - time.monotonic()))
            self._wake.clear()

    def _probe(self, endpoints: list[str]) -> None:
        clients: dict[str, tuple[ControlClient, int]] = {}
        for endpoint in endpoints:
            try:
                # Over TCP even on this host: liveness needs only the public info.
                client = ControlClient(endpoint, timeout_s=self._timeout_s, curve=self._curve, local=False)
            except Exception as exc:  # a malformed endpoint, no sockets left: it stays down
                log.debug("probe of %s not made: %s", endpoint, exc)
                continue
            try:
                clients[endpoint] = client, client.send(m.InfoRequest())
            except Exception as exc:
                log.debug("probe of %s not sent: %s", endpoint, exc)
                client.close()
        deadline = time.monotonic() + self._timeout_s
        try:
            while clients and time.monotonic() < deadline:
                # one probe waits in its socket's poll; several take turns
                wait_ms = int((deadline - time.monotonic()) * 1000) if len(clients) == 1 else 5
                for endpoint, (client, request_id) in list(clients.items()):
                    try:
                        reply = client.poll_reply(request_id, max(0, wait_ms))
                    except Exception as exc:  # refused or unreadable: an answer all the same
                        log.debug("probe of %s: %s", endpoint, exc)
                        reply = m.Info(info={})
                    if reply is not None:
                        clients.pop(endpoint)
                        client.close()
                        self._answered(endpoint, reply.info if isinstance(reply, m.Info) else {})
        finally:
            for client, _ in clients.values():
                client.close()

    def _answered(self, endpoint: str, info: dict) -> None:
        with self._lock:
            recovered = self._reach.probe_answered(endpoint)
        if recovered:
            log.info("peer %s answers again: no longer skipped", endpoint)
            self._on_answer(endpoint, info)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
