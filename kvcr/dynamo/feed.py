"""The runner's event stream, made safe for Dynamo's `KvEventPublisher` relay (I/O around DynamoFeed).

The runner's stream comes in through kvcr's subscriber (seq gaps replayed, restarts noticed), and
goes out on an XPUB socket that only Dynamo's relay connects to. XPUB reports the relay's
subscription, so nothing is published before someone listens, and every (re)subscription starts
Dynamo's view over from a snapshot taken on the runner's control socket.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from ..client import ControlClient, ControlError
from ..config import CurveKeys
from ..drivers.zmq_subscriber import Delivery, Notice, Subscriber
from ..proto.dynamo_feed import DynamoFeed
from ..proto.events import MEDIUM_DISK, MEDIUM_DRAM, Event, EventBatch, batch_frames

log = logging.getLogger(__name__)
RUNNER = "runner"
SNAPSHOT_RETRY_S = 1.0


class FeedRelay:
    def __init__(self, *, events: str, replay: str | None, control: str, dp_rank: int,
                 dead_after_s: float = 3.0, bind: str = "tcp://127.0.0.1:0", curve: CurveKeys | None = None) -> None:
        self.ctx = zmq.Context.instance()
        self.control = control
        self.dp_rank = dp_rank
        self.state = DynamoFeed(dead_after_s)
        self.subscriber = Subscriber(ctx=self.ctx)
        self.subscriber.add(RUNNER, events, replay, curve)
        self.xpub = self.ctx.socket(zmq.XPUB)
        self.xpub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscribe, even a repeated one, is a resync
        self.xpub.setsockopt(zmq.LINGER, 0)
        # Dynamo's relay ignores seq gaps: a batch XPUB dropped at its high-water mark would leave its
        # counts wrong for good, so nothing is dropped (the runner's own PUB bounds the rate).
        self.xpub.setsockopt(zmq.SNDHWM, 0)
        self.xpub.bind(bind)
        self.endpoint = self.xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self._next_snapshot = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcr-dynamo-feed", daemon=True)

    def start(self) -> "FeedRelay":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
        except Exception:  # noqa: BLE001 - the bridge watches alive() and exits: Dynamo then deregisters us
            log.exception("Dynamo event feed stopped")
            raise
        finally:
            self.subscriber.close()
            self.xpub.close()

    def _step(self) -> None:
        self._subscriptions()
        for item in self.subscriber.poll(100):
            now = time.monotonic()
            if isinstance(item, Notice) and item.kind in ("restart", "lost"):
                log.warning("runner stream: %s (%s); Dynamo's view is cleared until a snapshot (clear %d)",
                            item.kind, item.detail, self.state.num_clears + 1)
                self._apply(lambda: self.state.lost(now, f"{item.kind}: {item.detail}"))
            elif isinstance(item, Delivery):
                self._apply(lambda: self.state.batch(item.batch.events, now))
        if self._apply(lambda: self.state.tick(time.monotonic())):
            log.warning("%s: Dynamo's view is cleared until the runner is heard again", self.state.last_problem)
        if self.state.wants_snapshot and time.monotonic() >= self._next_snapshot:
            self._resync()

    def _subscriptions(self) -> None:
        while self.xpub.poll(0):
            message = self.xpub.recv()
            if message[:1] == b"\x01":
                log.info("Dynamo's relay subscribed: its view of the runner starts from a snapshot")
                self._apply(lambda: self.state.subscribed(time.monotonic()))
                self._next_snapshot = 0.0

    def _resync(self) -> None:
        try:
            with ControlClient(self.control, timeout_s=2.0, ctx=self.ctx) as client:
                seq, events = client.snapshot()
        except (TimeoutError, ControlError, OSError, zmq.ZMQError, ValueError) as exc:  # ValueError: a bad reply
            self._next_snapshot = time.monotonic() + SNAPSHOT_RETRY_S
            log.info("runner snapshot unavailable (%s); retrying", exc)
            return
        self.subscriber.start_after(RUNNER, seq)
        self._apply(lambda: self.state.snapshot(events, time.monotonic()))
        log.info("Dynamo's view resynced (%d so far): %d host-pinned and %d disk blocks as of runner batch %d",
                 self.state.num_resyncs, self.state.blocks(MEDIUM_DRAM), self.state.blocks(MEDIUM_DISK), seq)

    def _apply(self, step) -> bool:
        """Publish what a step of the state machine says Dynamo must be told; True if anything."""
        events: tuple[Event, ...] = step()
        if events:
            batch = EventBatch(ts=time.time(), events=events, dp_rank=self.dp_rank)
            self.xpub.send_multipart(batch_frames(b"", self.seq, batch))
            self.seq += 1
        return bool(events)
