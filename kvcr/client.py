"""Client side of the control socket, and a writer that attaches to a runner's DRAM region."""

from __future__ import annotations

import itertools
import json
import os
import time
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import zmq

from .config import CurveKeys
from .drivers.local_control import LocalChannel
from .drivers.shm import Region, host_id
from .drivers.zmq_curve import secure_client
from .proto import messages as m
from .proto.announce import Announce
from .proto.events import Event, decode_event


class ControlError(RuntimeError):
    """The runner refused a request; `code` is its machine-readable reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ZmqChannel:
    """A ZMQ DEALER to a runner's control socket (CURVE where keys are set): any host."""

    def __init__(self, ctx: zmq.Context, endpoint: str, curve: CurveKeys | None) -> None:
        self._ctx, self._endpoint, self._curve = ctx, endpoint, curve
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, self._curve)
        sock.connect(self._endpoint)
        return sock

    def send(self, payload: bytes) -> None:
        # REQ-style [empty, payload]: what every runner version accepts (newer ones take one frame too)
        self._sock.send_multipart([b"", payload])

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._sock.poll(timeout_ms))

    def recv(self) -> bytes:
        return self._sock.recv_multipart()[-1]

    def reset(self) -> None:
        """Drop the socket (and any reply still on its way) and connect a new one."""
        self._sock.close()
        self._sock = self._connect()

    def close(self, linger_ms: int = 0) -> None:
        """With `linger_ms`, messages already sent still leave for that long (ZMQ drops them after)."""
        self._sock.close(linger=linger_ms)


class Channel(Protocol):
    """What a ControlClient sends frames over: ZmqChannel, or LocalChannel on the source's host."""

    def send(self, payload: bytes) -> None: ...
    def poll(self, timeout_ms: int) -> bool: ...
    def recv(self) -> bytes: ...
    def reset(self) -> None: ...
    def close(self, linger_ms: int = 0) -> None: ...


class ControlClient:
    def __init__(self, endpoint: str, *, timeout_s: float = 5.0, ctx: zmq.Context | None = None,
                 curve: CurveKeys | None = None, channel: Channel | None = None, spin_s: float = 0.0,
                 local: bool = True) -> None:
        """`curve`: the deployment keypair; None takes it from the environment (CurveKeys.from_env),
        so the router and every CLI command speak CURVE where it is set. `channel`: another way to
        the same runner (its same-host socket); by default a ZMQ socket to `endpoint`. `spin_s`: how
        long a request first waits for its reply without sleeping (see `poll_reply`). `local`:
        without keys, ask a runner on this host over its same-host socket once its info names it
        (a keyless runner serves claims, fills and its region's addresses only there)."""
        self.endpoint = endpoint
        self.curve = curve if curve is not None else CurveKeys.from_env()
        self.timeout_ms = int(timeout_s * 1000)
        self.incarnation = uuid.uuid4().hex[:16]
        self._ids = itertools.count(1)
        self._channel = channel or ZmqChannel(ctx or zmq.Context.instance(), endpoint, self.curve)
        # With a handler, a request that timed out keeps the socket: its late reply goes to the
        # handler (a late grant must be released on the socket that owns it). Without, start afresh.
        self.on_late_reply: Callable[[m.Message], None] | None = None
        self._abandoned: set[int] = set()
        self.spin_s = spin_s
        self.is_local = isinstance(channel, LocalChannel)
        self._find_local = local and channel is None and self.curve is None and endpoint.startswith("tcp://")

    def close(self, linger_ms: int = 0) -> None:
        """With `linger_ms`, messages already sent still leave for that long."""
        self._channel.close(linger_ms)

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv(self, request_id: int, timeout_ms: int | None = None) -> m.Message:
        timeout_ms = self.timeout_ms if timeout_ms is None else timeout_ms
        reply = self.poll_reply(request_id, timeout_ms)
        if reply is None:
            if self.on_late_reply is not None:
                self._abandoned.add(request_id)
            else:  # nobody would act on a late reply: drop it with the socket
                self._channel.reset()
            raise TimeoutError(f"no reply from {self.endpoint} within {timeout_ms} ms")
        return reply

    @property
    def num_abandoned(self) -> int:
        """Requests that timed out whose late reply has not come (yet)."""
        return len(self._abandoned)

    def drain_late(self) -> None:
        """Read replies that arrived after their request timed out (no wait)."""
        self.poll_reply(0, 0)  # request ids start at 1: every reply read here is a late one

    def _late(self, reply: m.Message) -> None:
        if reply.request_id in self._abandoned:
            self._abandoned.discard(reply.request_id)
            if self.on_late_reply is not None:
                self.on_late_reply(reply)

    def go_local(self, path: str) -> bool:
        """Ask over the runner's same-host socket at `path` from now on; False (staying on ZMQ)
        when it cannot be reached or another user serves it. Only before the first claim: a claim
        belongs to the connection it came on."""
        self._find_local = False
        if self.is_local:
            return True
        try:
            channel = LocalChannel(path, self.timeout_ms / 1000)
        except OSError:
            return False
        self._channel.close()
        self._channel, self.is_local = channel, True
        return True

    def _go_local_if_keyless(self) -> None:
        """Before the first request: the runner's public info says whether it has a same-host
        socket we can use (it is on this host). No answer raises TimeoutError, as the request would."""
        request_id = next(self._ids)
        self._channel.send(m.encode(m.InfoRequest(), request_id=request_id, incarnation=self.incarnation))
        reply = self.poll_reply(request_id, self.timeout_ms)
        if reply is None:
            self._channel.reset()
            raise TimeoutError(f"no reply from {self.endpoint} within {self.timeout_ms} ms")
        info = reply.info if isinstance(reply, m.Info) else {}
        path = info.get("endpoints", {}).get("local_control", "")
        if path and info.get("host_id") and info.get("host_id") == host_id():
            self.go_local(path)
        self._find_local = False

    def send(self, msg: m.Message) -> int:
        """Send a request without waiting; returns its id for poll_reply."""
        if self._find_local:
            self._go_local_if_keyless()
        request_id = next(self._ids)
        self._channel.send(m.encode(msg, request_id=request_id, incarnation=self.incarnation))
        return request_id

    def poll_reply(self, request_id: int, timeout_ms: int = 0) -> m.Message | None:
        """The reply to `request_id` if it arrives within `timeout_ms` (raises ControlError on a refusal).
        The first `spin_s` of the wait polls without sleeping: a fast peer answers within a claim's
        round trip, and a sleeping thread's wake-up (tens of µs, more on a VM) would add to it."""
        deadline = time.monotonic() + timeout_ms / 1000
        if timeout_ms > 0 and self.spin_s > 0:
            self._spin(min(deadline, time.monotonic() + self.spin_s))
        while True:
            if not self._channel.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                return None
            reply = m.decode(self._channel.recv())
            if reply.request_id == request_id:
                if isinstance(reply, m.Error):
                    raise ControlError(reply.code, reply.message)
                return reply
            self._late(reply)

    def _spin(self, until: float) -> None:
        while not self._channel.poll(0) and time.monotonic() < until:
            pass

    def request(self, msg: m.Message, *, timeout_s: float | None = None) -> m.Message:
        request_id = self.send(msg)
        return self._recv(request_id, None if timeout_s is None else int(timeout_s * 1000))

    def info(self) -> dict:
        return self.request(m.InfoRequest()).info

    def snapshot(self) -> tuple[int, list[Event]]:
        """(seq, events): the inventory as of batch `seq`; continue the live stream after it."""
        request_id = self.send(m.SnapshotRequest())
        events: list[Event] = []
        while True:
            part = self._recv(request_id)
            events.extend(decode_event(e) for e in part.events)
            if part.done:
                return part.seq, events


def fetch_info(endpoint: str, timeout_s: float = 5.0, *, token: str = "", curve: CurveKeys | None = None) -> dict:
    """A runner's info, from its control socket (tcp://, ipc://) or its HTTP endpoint (`token`:
    its runner.http_token). Only the control socket's answer holds what a peer pulls with."""
    if endpoint.startswith(("http://", "https://")):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(endpoint.rstrip("/") + "/info", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.load(resp)
    with ControlClient(endpoint, timeout_s=timeout_s, curve=curve) as client:
        return client.info()


@dataclass
class Claimed:
    """Offsets of the leading pages a claim pins; after the claim ends, `live` counts the leading
    ones whose slot kept its bytes for the whole claim (only those were read intact)."""

    offsets: list[int]
    live: int = 0


@dataclass
class Filling:
    """Offsets to write (-1: present, -2: another fill writes it) and, for a TP shard, where the
    shard starts inside a page. After the commit: pages committed (a shard: its fill's verdict)."""

    offsets: list[int]
    shard_offset: int = 0
    committed: int | str = 0


class AttachedWriter:
    """Writes and reads pages in a runner's shared-memory pool (same host), with fills and claims."""

    def __init__(self, client: ControlClient) -> None:
        self.client = client
        info = client.info()
        self.info = info
        self.pools = {p["name"]: p for p in info["pools"]}
        self.region = Region.attach(info["shm_path"])  # mapping is O(1), whatever the pool's size
        self.view = self.region.view

    def __enter__(self) -> "AttachedWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.view.release()
        self.region.close()

    @contextmanager
    def filling(self, pool: str, page_hexes: Sequence[str], announces: Sequence[Announce | None] | None = None, *,
                shard: int | None = None, lease_s: float = 0.0) -> Iterator[Filling]:
        """Reserve (or, for a TP shard, join the fill assembling exactly these pages), let the
        caller write, then commit; an exception commits nothing."""
        wire = [a.to_wire() if a else None for a in announces or []]
        if shard is None:
            reply = self.client.request(m.Reserve(pool=pool, keys=list(page_hexes), writer_pid=os.getpid(),
                                                  announces=wire, lease_s=lease_s))
            filling = Filling(reply.offsets)
        else:
            reply = self.client.request(m.ReserveShard(pool=pool, keys=list(page_hexes), shard=shard,
                                                       announces=wire, lease_s=lease_s))
            filling = Filling(reply.offsets, reply.shard_offset)
        ok = False
        try:
            yield filling
            ok = True
        finally:
            if shard is None:
                filling.committed = self.client.request(
                    m.Commit(fill_id=reply.fill_id, ok=[ok] * len(reply.offsets))).num_committed
            else:
                filling.committed = self.client.request(
                    m.CommitShard(fill_id=reply.fill_id, shard=shard, ok=ok)).verdict

    @contextmanager
    def claimed(self, pool: str, page_hexes: Sequence[str]) -> Iterator[Claimed]:
        """Pin the leading present pages while the caller reads them, then release."""
        grant = self.client.request(m.ClaimRequest(pool=pool, keys=list(page_hexes)))
        claimed = Claimed(list(grant.offsets))
        if not grant.offsets:
            yield claimed
            return
        try:
            yield claimed
        finally:
            released = self.client.request(m.ReleaseRequest(claim_id=grant.claim_id))
            claimed.live = next((i for i, live in enumerate(released.live) if not live), len(claimed.offsets))

    def put(self, pool: str, page_hexes: Sequence[str], pages: Sequence[bytes],
            announces: Sequence[Announce | None] | None = None) -> int:
        size = self.pools[pool]["page_bytes"]
        with self.filling(pool, page_hexes, announces) as fill:
            for offset, data in zip(fill.offsets, pages):
                if offset >= 0:
                    self.view[offset:offset + size] = data
        return fill.committed

    def get(self, pool: str, page_hexes: Sequence[str]) -> list[bytes]:
        size = self.pools[pool]["page_bytes"]
        with self.claimed(pool, page_hexes) as claim:
            out = [bytes(self.view[o:o + size]) for o in claim.offsets]
        return out[:claim.live]  # only the pages whose slot stayed live for the whole claim
