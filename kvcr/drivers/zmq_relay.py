"""Engine relay: subscribes to the engine's KV event stream and republishes it through the runner.

The decisions (forward, replay, resync) come from kvcr.proto.relay.EngineMirror; this thread
only moves frames and performs the replay round trips it asks for.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import zmq

from .zmq_replay import ReplayAnswer, fetch_replay

from ..proto.events import BlockStored, EventError, decode_frames
from ..proto.relay import EngineMirror, RelayStep

if TYPE_CHECKING:
    from ..runner.events import EventStream

log = logging.getLogger(__name__)


class EngineRelay:
    def __init__(self, ctx: zmq.Context, runner, events: EventStream, *, endpoint: str, replay_endpoint: str = "",
                 replay_timeout_s: float = 2.0, hold_s: float = 0.0) -> None:
        """`runner`: its lock, clock and what it holds; `events`: its event stream, which engine
        batches join."""
        self._ctx = ctx
        self.runner = runner
        self.events = events
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.mirror = EngineMirror(block_size=runner.cfg.runner.block_size, hold_s=hold_s,
                                   runner_holds=runner.holds_event_hash)
        events.follower = self._runner_published
        self.num_relayed = 0
        self.num_malformed = 0
        self.num_problems = 0
        self.rebuilt_complete: bool | None = None
        self.error: BaseException | None = None
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
        try:
            sub.connect(self.endpoint)
            if self.replay_endpoint:
                self._rebuild()
            while not self._stop.is_set():
                if sub.poll(100):
                    self._on_frames(sub.recv_multipart())
                self._expire()
        except BaseException as exc:  # reported by health()
            self.error = exc
            log.exception("engine relay stopped")
        finally:
            sub.close()

    def health(self) -> str:
        if self.error is not None:
            return f"engine relay failed: {self.error!r}"
        return "" if self._thread.is_alive() or self._stop.is_set() else "engine relay thread is gone"

    def _rebuild(self) -> None:
        """After our own (re)start: learn what the engine holds from its replay buffer."""
        answer = self._replay(0)
        if answer is None:
            return
        with self.runner.lock:
            self.rebuilt_complete = self.mirror.rebuild(answer.batches, self.runner.clock())
            if self.rebuilt_complete:
                self.events.relay(RelayStep(events=tuple(self.mirror.inventory())))
        if not self.rebuilt_complete:
            log.warning("engine replay no longer starts at seq 0: its blocks are announced again only as "
                        "the engine re-stores them")

    def _runner_published(self, events) -> tuple:
        """Under the runner lock: engine blocks held back for pages the runner just stored."""
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        return self.mirror.runner_stored(stored, self.runner.clock()) if stored else ()

    def _expire(self) -> None:
        if self.mirror.waiting:
            with self.runner.lock:
                shown = self.mirror.expire(self.runner.clock())
                if shown:
                    self._apply(RelayStep(events=shown))

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            _, seq, batch = decode_frames(frames)
        except EventError as exc:
            self.num_malformed += 1
            log.warning("malformed engine batch dropped: %s", exc)
            return
        self.num_malformed += len(batch.rejected)
        # The mirror changes under the runner lock, so a snapshot sees it and our pages together.
        with self.runner.lock:
            step = self.mirror.on_batch(seq, batch, self.runner.clock())
            if step.replay_from < 0:
                self._apply(step)
                return
        answer = self._replay(step.replay_from)  # network I/O: outside the lock
        with self.runner.lock:
            for replay_step in self.mirror.after_replay(answer.batches if answer else (), step.replay_from, seq,
                                                         batch, self.runner.clock()):
                self._apply(replay_step)

    def _apply(self, step: RelayStep) -> None:
        if step.problem:
            self.num_problems += 1
            log.warning("engine stream: %s", step.problem)
        if step.events or step.resync:
            self.events.relay(step)
            self.num_relayed += 1

    def _replay(self, start: int) -> ReplayAnswer | None:
        if not self.replay_endpoint:
            return None
        answer = fetch_replay(self._ctx, self.replay_endpoint, start, self.replay_timeout_ms)
        self.num_malformed += answer.num_malformed
        if not answer.complete:
            log.warning("engine replay from %d timed out", start)
        return answer
