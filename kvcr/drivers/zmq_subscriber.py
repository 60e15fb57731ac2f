"""Subscriber: follows runners' and engines' event streams, repairing gaps by replay.

Per publisher it tracks seq (kvcr.proto.stream), asks the replay socket for a gap, and falls
back to a snapshot callback when replay cannot fill it. Malformed frames are counted, never fatal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator

import zmq

from kvcr.config import CurveKeys
from kvcr.proto.events import AllBlocksCleared, EventBatch, EventError, decode_frames
from kvcr.proto.stream import StreamTracker, Verdict
from .zmq_curve import secure_client
from .zmq_replay import ReplayAnswer, fetch_replay

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Delivery:
    publisher: str
    seq: int
    batch: EventBatch
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class Notice:
    """Something a consumer should know besides events: a gap, a restart, an unrepaired loss."""

    publisher: str
    kind: str
    detail: str


@dataclass
class _Publisher:
    name: str
    endpoint: str
    replay_endpoint: str | None
    curve: CurveKeys | None
    tracker: StreamTracker = field(default_factory=StreamTracker)


class Subscriber:
    def __init__(self, *, ctx: zmq.Context | None = None, topic: bytes = b"", replay_timeout_s: float = 2.0,
                 on_unrepaired: Callable[[str], None] | None = None, heartbeat_s: float = 1.0) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._topic = topic
        self._publishers: dict[str, _Publisher] = {}
        self._sockets: dict[str, zmq.Socket] = {}
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.on_unrepaired = on_unrepaired
        self.heartbeat_ms = int(heartbeat_s * 1000)
        self.num_malformed = 0

    def add(self, name: str, endpoint: str, replay_endpoint: str | None = None,
            curve: CurveKeys | None = None) -> None:
        """`curve`: the deployment keypair, for a publisher whose events and replay speak CURVE."""
        # One SUB socket per publisher: frames carry no sender, so the socket tells streams apart.
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        sock.setsockopt(zmq.LINGER, 0)
        if self.heartbeat_ms:
            # A SUB sends nothing, so a connection its publisher's side dropped (reset, or a host
            # gone without a FIN) would look open for good: a ping unanswered for three beats
            # closes it, ZMQ reconnects, and the batches missed show as a gap replay repairs.
            sock.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self.heartbeat_ms)
        secure_client(sock, curve)
        sock.connect(endpoint)
        self._publishers[name] = _Publisher(name, endpoint, replay_endpoint, curve)
        self._sockets[name] = sock

    def remove(self, name: str) -> None:
        self._publishers.pop(name, None)
        sock = self._sockets.pop(name, None)
        if sock is not None:
            sock.close()

    def start_after(self, name: str, seq: int) -> None:
        """Continue `name` after a snapshot taken at `seq`."""
        self._publishers[name].tracker.start_after_snapshot(seq)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()

    def poll(self, timeout_ms: int) -> Iterator[Delivery | Notice]:
        poller = zmq.Poller()
        for sock in self._sockets.values():
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        for name, sock in self._sockets.items():
            if sock not in ready:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                yield from self._on_frames(self._publishers[name], frames)

    def _on_frames(self, pub: _Publisher, frames: list[bytes]) -> Iterator[Delivery | Notice]:
        try:
            _, seq, batch = decode_frames(frames)
        except EventError as exc:
            self.num_malformed += 1
            yield Notice(pub.name, "malformed", str(exc))
            return
        yield from self._rejected(pub, batch)
        starts_with_clear = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
        verdict, gap_start = pub.tracker.observe(seq, starts_with_clear)
        if verdict is Verdict.STALE:
            return
        if verdict is Verdict.RESTART:
            yield Notice(pub.name, "restart", f"seq went back to {seq}")
        if verdict is Verdict.GAP:
            yield Notice(pub.name, "gap", f"missing [{gap_start}, {seq})")
            yield from self._replay(pub, gap_start, seq)
        pub.tracker.advance(seq)
        yield Delivery(pub.name, seq, batch)

    def _replay(self, pub: _Publisher, start: int, trigger: int) -> Iterator[Delivery | Notice]:
        if pub.replay_endpoint is None:
            answer = ReplayAnswer((), 0, True)
        else:
            answer = fetch_replay(self._ctx, pub.replay_endpoint, start, self.replay_timeout_ms, pub.curve)
        self.num_malformed += answer.num_malformed
        plan = pub.tracker.plan_replay([s for s, _ in answer.batches], start, trigger)
        if plan.lost is not None:
            why = "no replay endpoint" if pub.replay_endpoint is None else \
                "replay timed out" if not answer.complete else "replay buffer no longer holds it"
            if self.on_unrepaired is not None:
                self.on_unrepaired(pub.name)
            yield Notice(pub.name, "lost", f"batches [{plan.lost[0]}, {plan.lost[1]}) not repaired: {why}")
        wanted = set(plan.deliver)
        for seq, batch in answer.batches:
            if seq in wanted:
                pub.tracker.advance(seq, replayed=True)
                yield from self._rejected(pub, batch)
                yield Delivery(pub.name, seq, batch, replayed=True)

    def _rejected(self, pub: _Publisher, batch: EventBatch) -> Iterator[Notice]:
        for reason in batch.rejected:
            self.num_malformed += 1
            yield Notice(pub.name, "malformed", f"event dropped: {reason}")
