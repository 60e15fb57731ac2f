"""Opportunistic sources: follow the peers' event streams (a thread), so a lookup that brings no
hint can still find which peer holds the pages (Dynamo with stock SGLang workers, any router that
knows nothing of kvcr). Peers come from a list of endpoints and from a peers directory or etcd."""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client.core import GaugeMetricFamily

from kvcr.client import ControlClient, ControlError, fetch_info
from kvcr.config import CurveKeys
from kvcr.drivers.zmq_subscriber import Delivery, Notice, Subscriber
from kvcr.proto.events import EventBatch
from kvcr.proto.peer_inventory import PeerInventory

from .peer_directory import PeerDirectory
from .peer_etcd import EtcdError, EtcdPeers

log = logging.getLogger(__name__)
RETRY_S = 2.0


class PeerFeed:
    def __init__(self, endpoints: list[str], own_control: str, curve: CurveKeys | None = None, *,
                 directory: PeerDirectory | EtcdPeers | None = None, namespaces: frozenset[str] = frozenset()) -> None:
        self.own = own_control
        self.curve = curve  # our runner's keys: its peers share them
        self.inventory = PeerInventory()
        self.lock = threading.Lock()
        self._waiting = list(endpoints)   # info endpoints not reached yet
        self.directory = directory
        self.namespaces = namespaces      # a directory peer serving none of our pools is not followed
        # control endpoint -> how many sources name it (a list entry, directory entries: a restarted
        # peer's new entry may come before its old one goes); followed while above 0
        self._sources: dict[str, int] = {}
        self._listed: dict[str, str | None] = {}  # directory file -> the endpoint it made us follow
        self._failures: dict[str, int] = {}  # peer -> snapshots failed in a row (retries back off)
        self._registry_down = False  # etcd unreachable: warned once per outage
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
            self._follow(control, events, replay, info.get("events_curve") is True)

    def _scan(self) -> None:
        """Follow the directory's new entries; stop following those whose files went."""
        self.directory.rejoin()
        try:
            entries = self.directory.entries()
        except EtcdError as exc:  # etcd away: the peers followed stay followed until it answers
            if not self._registry_down:
                log.warning("kvcr peer feed: peers not listed: %s", exc)
            self._registry_down = True
            return
        self._registry_down = False
        for name in set(self._listed) - set(entries):
            control = self._listed.pop(name)
            if control is not None:
                self._unfollow(control)
        for name, entry in entries.items():
            if name in self._listed:
                continue
            if self.namespaces and not self.namespaces & entry.namespace_digests:
                log.info("peer %s serves another model or layout: not followed", entry.control)
                self._listed[name] = None
                continue
            followed = self._follow(entry.control, entry.events, entry.replay, entry.events_curve)
            self._listed[name] = entry.control if followed else None

    def _follow(self, control: str, events: str, replay: str | None, events_curve: bool) -> bool:
        if control == self.own:
            return False
        if control in self._sources:
            self._sources[control] += 1
            return True
        if events_curve and self.curve is None:
            log.warning("peer %s publishes its events with CURVE and this runner holds no keys: not followed",
                        control)
            return False
        log.info("following peer %s", control)
        self.subscriber.add(control, events, replay, self.curve if events_curve else None)
        with self.lock:
            self._sources[control] = 1
        self._resync[control] = 0.0
        return True

    def _unfollow(self, control: str) -> None:
        if self._sources.get(control, 0) > 1:
            self._sources[control] -= 1
            return
        log.info("peer %s left", control)
        self.subscriber.remove(control)
        self._resync.pop(control, None)
        self._failures.pop(control, None)
        with self.lock:
            self._sources.pop(control, None)
            self.inventory.forget(control)

    def _snapshot(self, control: str) -> None:
        try:
            with ControlClient(control, timeout_s=5.0, curve=self.curve) as client:
                seq, events = client.snapshot()
        except (TimeoutError, ControlError, OSError) as exc:
            # A peer that does not answer holds this thread up to 5 s a try: back off to a minute.
            n = self._failures[control] = self._failures.get(control, 0) + 1
            wait = min(RETRY_S * 2 ** (n - 1), 60.0)
            log.info("snapshot of peer %s failed (retried in %.0f s): %s", control, wait, exc)
            self._resync[control] = time.monotonic() + wait
            return
        with self.lock:
            self.inventory.forget(control)
            self.inventory.apply(control, EventBatch(ts=time.time(), events=tuple(events)))
        log.info("peer %s: snapshot loaded (%d events)", control, len(events))
        self.subscriber.start_after(control, seq)
        self._resync.pop(control, None)
        self._failures.pop(control, None)

    def _run(self) -> None:
        next_try = 0.0
        while not self._stop.is_set():
            try:
                next_try = self._step(next_try)
            except Exception:  # one bad entry or answer must not end the feed for good
                log.exception("kvcr peer feed: step failed (going on in %.0f s)", RETRY_S)
                self._stop.wait(RETRY_S)

    def _step(self, next_try: float) -> float:
        if time.monotonic() >= next_try:
            if self._waiting:
                self._discover()
            if self.directory is not None:
                self._scan()
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
        return next_try

    def collect(self):
        """Prometheus: the peers followed and the blocks each is known to serve (the runner's /metrics)."""
        blocks = GaugeMetricFamily("kvcr_peer_feed_blocks", "Blocks a followed peer's runner holds, from its events",
                                   labels=["peer"])
        with self.lock:
            for peer in sorted(self._sources):
                blocks.add_metric([peer], self.inventory.num_blocks(peer))
        yield blocks

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)  # a snapshot in progress ends within its 5 s timeout
        if not self._thread.is_alive():  # its sockets belong to the thread while it runs
            self.subscriber.close()
