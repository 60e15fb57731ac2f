"""Peers found through etcd (extra-config `peers_etcd`): engines on many hosts, or where Dynamo's
etcd already runs. Each runner puts its public info under `kvcr/peers/`, held by a lease that a
thread of its own renews, so an engine that stops or dies leaves when its lease ends; each
follows the others'.

It answers as `PeerDirectory` does (join, rejoin, entries, leave), so the peer feed follows either.
etcd is trusted as Dynamo trusts it: whatever is registered there is followed. The client sends
no credentials (an etcd with auth refuses it, and the warning says so). Pulls still speak the
runner's security (CURVE keys, docs/security.md), so an entry alone reaches no page.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict

from kvcr.drivers import etcd
from kvcr.drivers.etcd import EtcdError

from .peer_directory import Origin, PeerEntry

__all__ = ["EtcdError", "EtcdPeers"]
log = logging.getLogger(__name__)
PREFIX = "kvcr/peers/"
TTL_S = 10      # a runner gone this long leaves


class EtcdPeers:
    def __init__(self, endpoint: str, prefix: str = PREFIX, ttl_s: int = TTL_S) -> None:
        self.endpoint, self.prefix, self.ttl_s = endpoint.rstrip("/"), prefix, ttl_s
        self.here = Origin.here()
        self.own: str | None = None   # our key
        self._value: str | None = None
        self._lease: str | None = None  # granted, and our key put under it
        self._lock = threading.Lock()   # the renewal thread against leave
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False           # warned once per outage
        self._skipped: set[str] = set()

    def _call(self, path: str, body: dict, *, expect: str | None = None) -> dict:
        return etcd.call(self.endpoint, path, body, expect=expect)

    def join(self, info: dict) -> str:
        """Register, and keep registered until `leave` (an etcd down meanwhile: a warning, and
        registered once it answers)."""
        self._value = json.dumps({"origin": asdict(self.here), "info": info})
        self.own = f"{self.prefix}{self.here.hostname}-{self.here.pid}-{info['incarnation']}"
        self._renew()
        self._thread = threading.Thread(target=self._run, name="kvcr-peers-etcd", daemon=True)
        self._thread.start()
        return self.own

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            self._renew()

    def _renew(self) -> None:
        with self._lock:
            if self.own is None:
                return
            try:
                if self._lease is not None:
                    answer = self._call("/v3/lease/keepalive", {"ID": self._lease}).get("result", {})
                    if int(answer.get("TTL", 0)) > 0:
                        self._recovered()
                        return
                    log.info("peers_etcd: our lease at %s had ended: entry put again", self.endpoint)
                    self._lease = None
                self._put()
                self._recovered()
            except EtcdError as exc:
                if not self._failing:
                    log.warning("peers_etcd: not registered (tried again every %.1f s): %s", self.ttl_s / 4, exc)
                self._failing = True

    def _recovered(self) -> None:
        if self._failing:
            log.info("peers_etcd: registered at %s again", self.endpoint)
        self._failing = False

    def _put(self) -> None:
        lease = str(self._call("/v3/lease/grant", {"TTL": self.ttl_s}, expect="ID")["ID"])
        try:
            self._call("/v3/kv/put", {"key": etcd.b64(self.own), "value": etcd.b64(self._value), "lease": lease})
        except EtcdError:
            try:  # a lease with no key would be renewed for nothing
                self._call("/v3/lease/revoke", {"ID": lease})
            except EtcdError:
                pass  # it ends with its TTL
            raise
        self._lease = lease

    def rejoin(self) -> None:
        """Nothing to do: the registry's own thread keeps the entry (the directory's rewrites a removed file)."""

    def leave(self) -> None:
        """Revoke our lease (the entry goes with it); only the process that joined does."""
        if os.getpid() != self.here.pid:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * etcd.TIMEOUT_S + 1)
        with self._lock:
            if self._lease is not None:
                try:
                    self._call("/v3/lease/revoke", {"ID": self._lease})
                except EtcdError as exc:
                    log.info("peers_etcd: leaving: %s (the entry ends with its lease)", exc)
            self.own = self._value = self._lease = None

    def entries(self) -> dict[str, PeerEntry]:
        """etcd key -> entry, for every peer registered but us; an unreadable one skipped with a
        warning. The lease removes a gone peer's entry; one of this host and boot whose process
        ended is skipped until then."""
        found: dict[str, PeerEntry] = {}
        for key, value in etcd.range_prefix(self.endpoint, self.prefix).items():
            if key == self.own:
                continue
            try:
                entry = PeerEntry.decode(json.loads(value))
            except (KeyError, ValueError, TypeError) as exc:
                if key not in self._skipped:
                    self._skipped.add(key)
                    log.warning("peers_etcd: %s is not a runner's entry, skipped: %s", key, exc)
                continue
            # Another host of the same name has another boot id: only ours is judged by pid.
            if entry.origin.boot == self.here.boot and entry.origin.gone(self.here):
                continue
            found[key] = entry
        return found
