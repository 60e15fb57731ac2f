"""One source runner as a puller knows it: its control socket, its queued releases, its region.

I/O only: what to send and when is decided by the pull (`kvcr/proto/pull.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Iterator

import zmq

from ..client import ControlClient
from .local_control import LocalChannel
from ..proto import messages as m
from ..proto.pull import PeerError, SourceTerms
from .shm import Region, RegionError, host_id

log = logging.getLogger(__name__)
RELEASE_LINGER_MS = 200  # a forgotten source's socket still delivers the releases just sent


@dataclass
class PeerSource:
    endpoint: str
    client: ControlClient
    terms: SourceTerms
    address: bytes        # its UCX worker's
    region_base: int
    rkeys: dict[int, bytes]
    shm_path: str = ""
    host_id: str = ""
    local_control: str = ""  # its same-host control socket, if it has one
    lock: threading.Lock = field(default_factory=threading.Lock)  # one request at a time on its socket
    region: Region | None = None  # its pool, mapped read-only, for same-host copies
    closed: bool = False          # forgotten: confirmations still holding it must not use it
    releases: list[m.ReleaseRequest] = field(default_factory=list)  # handed to the sender, not sent yet (FIFO)

    @classmethod
    def describe(cls, endpoint: str, client: ControlClient, info: dict) -> "PeerSource":
        """From the source's authenticated info reply (the only place its address and rkeys travel)."""
        if info["protocol"][0] != m.PROTOCOL_MAJOR:
            raise PeerError(f"{endpoint} speaks protocol {info['protocol']}, we speak "
                            f"{[m.PROTOCOL_MAJOR, m.PROTOCOL_MINOR]}")
        ucx = info.get("ucx")
        if not ucx or "ucx_get" not in info.get("capabilities", []):
            raise PeerError(f"{endpoint} does not serve UCX pulls")
        if "rkeys" not in ucx:
            raise PeerError(f"{endpoint} has no keys: it serves pulls only over its same-host socket, to its own "
                            "user (docs/security.md)")
        terms = SourceTerms(info["incarnation"], {p["name"]: p["page_bytes"] for p in info["pools"]},
                            tuple((off, length) for off, length, _ in ucx["rkeys"]), "move" in info["capabilities"])
        return cls(endpoint, client, terms, bytes.fromhex(ucx["address"]), ucx["region_base"],
                   {off: bytes.fromhex(k) for off, _, k in ucx["rkeys"]},
                   info.get("shm_path", ""), info.get("host_id", ""),
                   info.get("endpoints", {}).get("local_control", ""))

    def go_local(self) -> None:
        """On its host, ask it over its Unix socket from now on: no ZMQ I/O threads in a claim's
        round trip. Only before the first claim (a claim belongs to the connection it came on)."""
        if not self.local_control or not self.on_same_host():
            return
        if not self.client.go_local(self.local_control):
            log.info("%s: its same-host socket %s refused us: asking over %s", self.endpoint, self.local_control,
                     self.endpoint)

    @property
    def incarnation(self) -> str:
        return self.terms.incarnation

    @contextlib.contextmanager
    def socket(self) -> Iterator[ControlClient]:
        """Its control client, alone, with queued releases sent first: a request never overtakes
        the release before it, so a claim right after a pull finds the previous one gone. Releases
        queued while we hold it go out as we leave (the sender does not wait for a busy socket)."""
        with self.lock:
            self.flush_releases()
            try:
                yield self.client
            finally:
                self.flush_releases()

    def flush_releases(self) -> None:
        """Send queued releases (call with `lock` held). A failed send is left to the lease."""
        while self.releases and not self.closed:
            with contextlib.suppress(zmq.ZMQError, OSError):
                self.client.send(self.releases.pop(0))

    def on_same_host(self) -> bool:
        return bool(self.host_id) and self.host_id == host_id() and os.access(self.shm_path, os.R_OK)

    def map_read_only(self) -> str:
        """Map its pool read-only (call with `lock` held); returns the problem, if any. Mapped at the
        grant, a source that dies after granting still holds, in our mapping, exactly the pages it
        claimed for us (its file may be unlinked by then)."""
        if self.region is not None:
            return ""
        if not self.on_same_host():
            return "the source is gone or not on this host"
        try:
            self.region = Region.attach(self.shm_path, writable=False)
        except (OSError, RegionError) as exc:
            return f"cannot map the source's pool: {exc}"
        return ""

    def close(self) -> None:
        """Forget it: queued releases still go out (else the claims wait for their lease)."""
        with self.lock:  # not while another thread uses the socket or copies from the mapping
            self.flush_releases()
            self.closed = True
            self.client.close(linger_ms=RELEASE_LINGER_MS)
            if self.region is not None:
                self.region.close()
                self.region = None
