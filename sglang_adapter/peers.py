"""Opportunistic sources: follow the peers' event streams (a thread), so a lookup that brings no
hint can still find which peer holds the pages (Dynamo with stock SGLang workers)."""

from __future__ import annotations

import logging
import threading
import time

from kvcr.client import ControlClient, ControlError, fetch_info
from kvcr.config import CurveKeys
from kvcr.drivers.zmq_subscriber import Delivery, Notice, Subscriber
from kvcr.proto.events import EventBatch
from kvcr.proto.peer_inventory import PeerInventory

log = logging.getLogger(__name__)
RETRY_S = 2.0


class PeerFeed:
    def __init__(self, endpoints: list[str], own_control: str, curve: CurveKeys | None = None) -> None:
        self.own = own_control
        self.curve = curve  # our runner's keys: its peers share them
        self.inventory = PeerInventory()
        self.lock = threading.Lock()
        self._waiting = list(endpoints)   # info endpoints not reached yet
        # peer -> when to (re)load its snapshot: just joined, or lost batches replay could not repair
        self._resync: dict[str, float] = {}
        self.subscriber = Subscriber(on_unrepaired=lambda peer: self._resync.setdefault(peer, 0.0))
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
                info = fetch_info(endpoint, timeout_s=2.0, curve=self.curve)
                ep = info["endpoints"]
                control, events, replay = ep["control"], ep["events"], ep.get("replay")
            except Exception as exc:  # unreachable yet, or an answer that is not a runner's info
                log.debug("peer %s not usable yet: %s", endpoint, exc)
                continue
            self._waiting.remove(endpoint)
            if control == self.own:
                continue
            if info.get("events_curve") is True and self.curve is None:
                log.warning("peer %s publishes its events with CURVE and this runner holds no keys: not followed",
                            control)
                continue
            self.subscriber.add(control, events, replay, self.curve if info.get("events_curve") is True else None)
            self._resync[control] = 0.0

    def _snapshot(self, control: str) -> None:
        try:
            with ControlClient(control, timeout_s=5.0, curve=self.curve) as client:
                seq, events = client.snapshot()
        except (TimeoutError, ControlError, OSError) as exc:
            log.info("snapshot of peer %s failed (retried in %.0f s): %s", control, RETRY_S, exc)
            self._resync[control] = time.monotonic() + RETRY_S
            return
        with self.lock:
            self.inventory.forget(control)
            self.inventory.apply(control, EventBatch(ts=time.time(), events=tuple(events)))
        self.subscriber.start_after(control, seq)
        self._resync.pop(control, None)

    def _run(self) -> None:
        next_try = 0.0
        while not self._stop.is_set():
            if self._waiting and time.monotonic() >= next_try:
                self._discover()
                next_try = time.monotonic() + RETRY_S
            for control, due in list(self._resync.items()):
                if due <= time.monotonic():
                    self._snapshot(control)
            for item in self.subscriber.poll(100):
                with self.lock:
                    if isinstance(item, Delivery):
                        self.inventory.apply(item.publisher, item.batch)
                    elif isinstance(item, Notice) and item.kind == "restart":
                        self.inventory.forget(item.publisher)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)  # a snapshot in progress ends within its 5 s timeout
        if not self._thread.is_alive():  # its sockets belong to the thread while it runs
            self.subscriber.close()
