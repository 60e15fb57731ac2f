"""Opportunistic sources: follow the peers' event streams (a thread), so a lookup that brings no
hint can still find which peer holds the pages (Dynamo with stock SGLang workers)."""

from __future__ import annotations

import logging
import threading
import time

from kvcr.cli import fetch_info
from kvcr.client import ControlClient, ControlError
from kvcr.proto.events import EventBatch
from kvcr.proto.peer_inventory import PeerInventory
from router_hints.subscriber import Delivery, Notice, Subscriber

log = logging.getLogger(__name__)
RETRY_S = 2.0


class PeerFeed:
    def __init__(self, endpoints: list[str], own_control: str) -> None:
        self.own = own_control
        self.inventory = PeerInventory()
        self.lock = threading.Lock()
        self._waiting = list(endpoints)   # info endpoints not reached yet
        self._resync: set[str] = set()    # peers whose stream lost batches replay could not repair
        self.subscriber = Subscriber(on_unrepaired=self._resync.add)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcr-peer-feed", daemon=True)

    def start(self) -> "PeerFeed":
        self._thread.start()
        return self

    def best_source(self, hashes: list[int]) -> tuple[str, int] | None:
        with self.lock:
            return self.inventory.best_source(hashes)

    def _discover(self) -> None:
        for endpoint in list(self._waiting):
            try:
                info = fetch_info(endpoint, timeout_s=2.0)
            except (TimeoutError, OSError) as exc:
                log.debug("peer %s not reachable yet: %s", endpoint, exc)
                continue
            self._waiting.remove(endpoint)
            ep = info["endpoints"]
            if ep["control"] == self.own:
                continue
            self.subscriber.add(ep["control"], ep["events"], ep.get("replay"))
            self._resync.add(ep["control"])

    def _snapshot(self, control: str) -> None:
        try:
            with ControlClient(control, timeout_s=5.0) as client:
                seq, events = client.snapshot()
        except (TimeoutError, ControlError, OSError) as exc:
            log.info("snapshot of peer %s failed (retried): %s", control, exc)
            return
        with self.lock:
            self.inventory.forget(control)
            self.inventory.apply(control, EventBatch(ts=time.time(), events=tuple(events)))
        self.subscriber.start_after(control, seq)
        self._resync.discard(control)

    def _run(self) -> None:
        next_try = 0.0
        while not self._stop.is_set():
            if self._waiting and time.monotonic() >= next_try:
                self._discover()
                next_try = time.monotonic() + RETRY_S
            for control in list(self._resync):
                self._snapshot(control)
            for item in self.subscriber.poll(100):
                with self.lock:
                    if isinstance(item, Delivery):
                        self.inventory.apply(item.publisher, item.batch)
                    elif isinstance(item, Notice) and item.kind == "restart":
                        self.inventory.forget(item.publisher)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.subscriber.close()
