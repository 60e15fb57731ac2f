"""Asking a publisher's replay socket for batches from a seq (the vLLM replay protocol, client side)."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from kvcr.config import CurveKeys
from kvcr.proto.events import REPLAY_END_SEQ, EventBatch, EventError, decode_frames, encode_seq
from .zmq_curve import secure_client


@dataclass(frozen=True, slots=True)
class ReplayAnswer:
    batches: tuple[tuple[int, EventBatch], ...]  # in seq order
    num_malformed: int
    complete: bool  # the end marker arrived before the timeout


def fetch_replay(ctx: zmq.Context, endpoint: str, start: int, timeout_ms: int,
                 curve: CurveKeys | None = None) -> ReplayAnswer:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, curve)
    sock.connect(endpoint)
    batches: list[tuple[int, EventBatch]] = []
    malformed = 0
    try:
        sock.send_multipart([b"", encode_seq(start)])
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()  # [empty, topic, seq, payload]; seq ff x 8 ends it
            if len(frames) == 4 and frames[2] == REPLAY_END_SEQ:
                return ReplayAnswer(tuple(sorted(batches, key=lambda b: b[0])), malformed, True)
            try:
                if len(frames) != 4:
                    raise EventError(f"a replayed batch has 4 frames, got {len(frames)}")
                _, seq, batch = decode_frames(frames[1:])
            except EventError:
                malformed += 1
                continue
            batches.append((seq, batch))
        return ReplayAnswer(tuple(sorted(batches, key=lambda b: b[0])), malformed, False)
    finally:
        sock.close()
