"""Event publisher: numbers batches, publishes them on a PUB socket and serves replay.

`publish()` never blocks the data path: it only appends to a bounded queue. When the queue is
full the batch is dropped but still consumes a seq number, so consumers see a gap and repair
it (replay misses it too, so they fall back to the runner's snapshot).

When idle it sends an empty batch every `heartbeat_s`: consumers only notice a loss (such as the
first batches of a restarted runner, sent before their SUB reconnected) when a later seq arrives.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Sequence

import zmq

from ..proto.events import REPLAY_END_SEQ, Event, EventBatch, decode_seq, encode_seq
from .wakeup import Waker
from .zmq_curve import CurveGate

log = logging.getLogger(__name__)
SEQ_RESERVATION = 1 << 20


class SeqSource:
    """Sequence numbers that keep rising across restarts.

    Seeded from the wall clock in microseconds and from a reservation persisted in `state_dir`,
    whichever is higher: a consumer drops any seq at or below the last one it saw.
    """

    def __init__(self, state_dir: str = "", now_us: int | None = None) -> None:
        self._path = Path(state_dir) / "seq.reserved" if state_dir else None
        persisted = 0
        if self._path is not None and self._path.exists():
            text = self._path.read_text().strip()
            persisted = int(text) if text.isdigit() else 0
        self.next = max(now_us if now_us is not None else time.time_ns() // 1000, persisted)
        self._reserved = self.next
        self._reserve()

    def _reserve(self) -> None:
        if self._path is None or self.next < self._reserved:
            return
        self._reserved = self.next + SEQ_RESERVATION
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(str(self._reserved))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)

    def take(self) -> int:
        seq = self.next
        self.next += 1
        self._reserve()
        return seq


class EventPublisher:
    def __init__(self, ctx: zmq.Context, *, endpoint: str, replay_endpoint: str, topic: str = "",
                 dp_rank: int | None = 0, buffer_steps: int = 10_000, queue_size: int = 100_000,
                 seq: SeqSource | None = None, heartbeat_s: float = 1.0, gate: CurveGate | None = None) -> None:
        self._ctx = ctx
        self._gate = gate
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self._queue: deque[tuple[int, EventBatch | None]] = deque()
        self._queue_size = queue_size
        self._replay: deque[tuple[int, list[bytes]]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._wake = Waker()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.seq = seq or SeqSource()
        self.heartbeat_s = heartbeat_s
        self._last_publish = time.monotonic()
        self.last_seq = self.seq.next - 1
        self.bound_endpoint = ""
        self.bound_replay_endpoint = ""
        self.num_batches = 0
        self.num_events = 0
        self.num_dropped = 0
        self.num_replay_requests = 0
        self.num_bad_replay_requests = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvcr-events", daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"event publisher failed to start: {self._error}")

    def publish(self, events: Sequence[Event]) -> int:
        """Queue one batch; returns its seq. Call under the owner's lock to keep batches ordered."""
        batch = EventBatch(ts=time.time(), events=tuple(events), dp_rank=self.dp_rank)
        with self._lock:
            seq = self.seq.take()
            self.last_seq = seq
            self._last_publish = time.monotonic()
            if len(self._queue) >= self._queue_size:
                self.num_dropped += 1
                self._queue.append((seq, None))  # a hole consumers will see
            else:
                self._queue.append((seq, batch))
        self._wake.wake()
        return seq

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._wake.close()

    def _run(self) -> None:
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 100_000)
            pub.setsockopt(zmq.LINGER, 1000)
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.SNDHWM, 2 * (self._replay.maxlen + 1))
            replay.setsockopt(zmq.LINGER, 0)
            if self._gate is not None:  # only subscribers holding an allowed key hear the stream
                self._gate.secure(pub)
                self._gate.secure(replay)
            pub.bind(self._endpoint)
            replay.bind(self._replay_endpoint)
            self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.bound_replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(replay, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        try:
            self._loop(pub, replay, poller)
        except BaseException as exc:  # reported by health(); the runner keeps serving pages
            self._error = exc
            log.exception("event publisher stopped")
        finally:
            self._drain(pub)
            pub.close()
            replay.close()

    def health(self) -> str:
        """Empty when publishing works, else what is wrong."""
        if self._error is not None:
            return f"event publisher failed: {self._error!r}"
        return "" if self._thread.is_alive() or self._stop.is_set() else "event publisher thread is gone"

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket, poller: zmq.Poller) -> None:
        while True:
            self._drain(pub)
            if self._stop.is_set():
                return
            if replay in dict(poller.poll(self._heartbeat_due_ms())):
                self._serve_replay(replay)
            if self.heartbeat_s and time.monotonic() - self._last_publish >= self.heartbeat_s:
                self.publish([])

    def _heartbeat_due_ms(self) -> int:
        if not self.heartbeat_s:
            return 1000
        return max(0, int((self._last_publish + self.heartbeat_s - time.monotonic()) * 1000) + 1)

    def _drain(self, pub: zmq.Socket) -> None:
        self._wake.clear()
        while True:
            with self._lock:
                if not self._queue:
                    return
                seq, batch = self._queue.popleft()
            if batch is None:
                continue
            frames = [self.topic, encode_seq(seq), batch.encode()]
            self._replay.append((seq, frames))
            pub.send_multipart(frames, copy=False)
            self.num_batches += 1
            self.num_events += len(batch.events)

    def _serve_replay(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.num_bad_replay_requests += 1
                log.warning("ignoring malformed replay request with %d frames", len(frames))
                continue
            self.num_replay_requests += 1
            ident, start = frames[0], decode_seq(frames[2])
            for seq, batch_frames in list(self._replay):
                if seq >= start:
                    sock.send_multipart([ident, b"", *batch_frames])
            sock.send_multipart([ident, b"", b"", REPLAY_END_SEQ, b""])
