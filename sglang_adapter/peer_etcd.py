"""Peers found through etcd (extra-config `peers_etcd`): engines on many hosts, or where Dynamo's
etcd already runs. Each runner puts its public info under `kvcr/peers/`, held by a lease it keeps
alive, so an engine that stops or dies leaves when its lease ends; each follows the others'.

It answers as `PeerDirectory` does (join, rejoin, entries, leave), so the peer feed follows either.
etcd is trusted as Dynamo trusts it: whatever is registered there is followed. Pulls still speak
the runner's security (CURVE keys, docs/security.md), so an entry alone reaches no page.
"""

from __future__ import annotations

import base64
import json
import logging
import urllib.request
from dataclasses import asdict

from .peer_directory import Origin, PeerEntry

log = logging.getLogger(__name__)
PREFIX = "kvcr/peers/"
TTL_S = 10      # a runner gone this long leaves; the feed renews every 2 s
TIMEOUT_S = 2.0


class EtcdError(OSError):
    pass


def _b64(raw: str) -> str:
    return base64.b64encode(raw.encode()).decode()


def prefix_end(prefix: str) -> str:
    """etcd's range end for every key starting with `prefix` (its last byte plus one)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class EtcdPeers:
    def __init__(self, endpoint: str, prefix: str = PREFIX, ttl_s: int = TTL_S) -> None:
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"peers_etcd = {endpoint!r} must be etcd's http(s):// client URL")
        self.endpoint, self.prefix, self.ttl_s = endpoint.rstrip("/"), prefix, ttl_s
        self.here = Origin.here()
        self.own: str | None = None   # our key
        self._value: str | None = None
        self._lease: str | None = None
        self._skipped: set[str] = set()

    def _call(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.endpoint + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
                # keepalive answers a stream of one message here: the first line is it
                return json.loads(resp.readline() or b"{}")
        except (OSError, ValueError) as exc:
            raise EtcdError(f"etcd at {self.endpoint}{path}: {exc}") from None

    def join(self, info: dict) -> str:
        self._value = json.dumps({"origin": asdict(self.here), "info": info})
        self.own = f"{self.prefix}{self.here.hostname}-{self.here.pid}-{info['incarnation']}"
        try:
            self._put()
        except EtcdError as exc:  # etcd not up yet: the feed's next rejoin tries again
            log.warning("peers_etcd: not registered yet: %s", exc)
        return self.own

    def _put(self) -> None:
        self._lease = str(self._call("/v3/lease/grant", {"TTL": self.ttl_s})["ID"])
        self._call("/v3/kv/put", {"key": _b64(self.own), "value": _b64(self._value), "lease": self._lease})

    def rejoin(self) -> None:
        """Renew our lease; one never granted (etcd was down) or expired (etcd restarted, or we were
        away past the TTL) is granted again and our entry put back."""
        if self.own is None:
            return
        if self._lease is None:
            self._put()
            return
        answer = self._call("/v3/lease/keepalive", {"ID": self._lease}).get("result", {})
        if int(answer.get("TTL", 0)) <= 0:
            log.info("peers_etcd: our lease at %s had ended: entry put again", self.endpoint)
            self._put()

    def leave(self) -> None:
        if self._lease is not None:
            try:
                self._call("/v3/lease/revoke", {"ID": self._lease})  # the entry goes with it
            except EtcdError as exc:
                log.info("peers_etcd: leaving: %s (the entry ends with its lease)", exc)
        self.own = self._value = self._lease = None

    def entries(self) -> dict[str, PeerEntry]:
        """etcd key -> entry, for every peer registered but us; an unreadable one skipped with a warning."""
        answer = self._call("/v3/kv/range", {"key": _b64(self.prefix), "range_end": _b64(prefix_end(self.prefix))})
        found: dict[str, PeerEntry] = {}
        for kv in answer.get("kvs", []):
            key = base64.b64decode(kv.get("key", "")).decode(errors="replace")
            if key == self.own:
                continue
            try:
                entry = PeerEntry.decode(json.loads(base64.b64decode(kv["value"])))
            except (KeyError, ValueError, TypeError) as exc:
                if key not in self._skipped:
                    self._skipped.add(key)
                    log.warning("peers_etcd: %s is not a runner's entry, skipped: %s", key, exc)
                continue
            if entry.origin.gone(self.here):  # ours, ended, its lease not yet out
                continue
            found[key] = entry
        return found
