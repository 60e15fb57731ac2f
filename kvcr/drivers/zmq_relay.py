"""Engine relay: subscribes to the engine's KV event stream and republishes it through the runner.

The decisions (forward, replay, resync) come from kvcr.proto.relay.EngineMirror; this thread
only moves frames and performs the replay round trips it asks for.
"""

from __future__ import annotations

import logging
import threading

import zmq

from ..proto.events import REPLAY_END_SEQ, EventBatch, EventError, decode_frames, encode_seq
from ..proto.relay import EngineMirror, RelayStep

log = logging.getLogger(__name__)


class EngineRelay:
    def __init__(self, ctx: zmq.Context, runner, *, endpoint: str, replay_endpoint: str = "",
                 replay_timeout_s: float = 2.0) -> None:
        self._ctx = ctx
        self.runner = runner
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.mirror = EngineMirror(block_size=runner.cfg.runner.block_size)
        self.num_relayed = 0
        self.num_malformed = 0
        self.num_problems = 0
        self.rebuilt_complete: bool | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcr-engine-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        try:
            if self.replay_endpoint:
                self._rebuild()
            while not self._stop.is_set():
                if sub.poll(100):
                    self._on_frames(sub.recv_multipart())
        finally:
            sub.close()

    def _rebuild(self) -> None:
        """After our own (re)start: learn what the engine holds from its replay buffer."""
        batches = self._replay(0)
        if batches is None:
            return
        self.rebuilt_complete = self.mirror.rebuild(batches)
        if self.rebuilt_complete:
            self.runner.relay(RelayStep(events=tuple(self.mirror.inventory())))
        else:
            log.warning("engine replay no longer starts at seq 0: its blocks are announced again only as "
                        "the engine re-stores them")

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            _, seq, batch = decode_frames(frames)
        except EventError as exc:
            self.num_malformed += 1
            log.warning("malformed engine batch dropped: %s", exc)
            return
        step = self.mirror.on_batch(seq, batch)
        if step.replay_from >= 0:
            replayed = self._replay(step.replay_from) or []
            for replay_step in self.mirror.on_replayed(replayed, step.replay_from):
                self._apply(replay_step)
            step = self.mirror.on_batch(seq, batch)  # STALE if replay already covered it
        self._apply(step)

    def _apply(self, step: RelayStep) -> None:
        if step.problem:
            self.num_problems += 1
            log.warning("engine stream: %s", step.problem)
        if step.events or step.resync:
            self.runner.relay(step)
            self.num_relayed += 1

    def _replay(self, start: int) -> list[tuple[int, EventBatch]] | None:
        if not self.replay_endpoint:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        out: list[tuple[int, EventBatch]] = []
        try:
            sock.send_multipart([b"", encode_seq(start)])
            while sock.poll(self.replay_timeout_ms):
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                if frames[2] == REPLAY_END_SEQ:
                    return out
                try:
                    _, seq, batch = decode_frames(frames[1:])
                except EventError:
                    self.num_malformed += 1
                    continue
                out.append((seq, batch))
            log.warning("engine replay from %d timed out", start)
            return out
        finally:
            sock.close()
