"""The router's subscriber fed by a vLLM-style publisher written here (raw ZMQ + msgpack, positional
events, the vLLM replay protocol): gaps are replayed, restarts clear, bad frames are skipped."""

import struct
import threading
import time

import msgpack
import pytest
import zmq

from router_hints.core import RouterCore
from router_hints.discovery import Publisher
from tests.helpers import wait_until

pytestmark = pytest.mark.pure

BLOCK = 4


class VllmPublisher:
    """PUB of [topic, seq (8B BE), msgpack [ts, [positional events], dp_rank]] plus a replay ROUTER."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: dict[int, bytes] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    @staticmethod
    def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> list:
        return ["BlockStored", hashes, parent, tokens, BLOCK, None, "GPU"]

    def send(self, seq: int, events: list, *, deliver: bool = True) -> None:
        payload = msgpack.packb([time.time(), events, 0])
        self.buffer[seq] = payload
        if deliver:
            self.pub.send_multipart([b"", struct.pack(">Q", seq), payload])

    def _serve_replay(self) -> None:
        while not self.stop.is_set():
            if not self.replay.poll(50):
                continue
            ident, _, start = self.replay.recv_multipart()
            first = struct.unpack(">Q", start)[0]
            for seq in sorted(s for s in self.buffer if s >= first):
                self.replay.send_multipart([ident, b"", b"", struct.pack(">Q", seq), self.buffer[seq]])
            self.replay.send_multipart([ident, b"", b"", b"\xff" * 8, b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close()
        self.replay.close()


@pytest.fixture
def feed():
    ctx = zmq.Context()
    pub = VllmPublisher(ctx)
    core = RouterCore(block_size=BLOCK)
    core.add(Publisher("vllm", 0, BLOCK, f"tcp://127.0.0.1:{pub.port}", f"tcp://127.0.0.1:{pub.replay_port}", None))
    time.sleep(0.3)  # slow joiner
    yield pub, core
    core.close()
    pub.close()
    ctx.term()


def depth(core: RouterCore, tokens: list[int]) -> int:
    core.poll(20)
    overlaps = core.index.overlaps(core.index.sequence_hashes(tokens))
    return overlaps[("vllm", 0)].depth if ("vllm", 0) in overlaps else 0


TOKENS = list(range(100, 100 + 3 * BLOCK))
PAGES = [TOKENS[i:i + BLOCK] for i in range(0, len(TOKENS), BLOCK)]


def test_a_gap_is_filled_from_the_replay_socket(feed):
    pub, core = feed
    pub.send(0, [pub.stored([11], None, PAGES[0])])
    pub.send(1, [pub.stored([12], 11, PAGES[1])], deliver=False)  # lost on the wire
    pub.send(2, [pub.stored([13], 12, PAGES[2])])
    assert wait_until(lambda: depth(core, TOKENS) == 3, 5, 0.02, "all three blocks after replay")


def test_a_restarted_publisher_is_cleared_before_its_new_stream(feed):
    pub, core = feed
    pub.send(5, [pub.stored([11, 12, 13], None, TOKENS)])
    wait_until(lambda: depth(core, TOKENS) == 3, 5, 0.02, "blocks stored")
    pub.buffer.clear()
    pub.send(0, [pub.stored([21], None, [9] * BLOCK)])  # a new process counting from 0
    wait_until(lambda: depth(core, [9] * BLOCK) == 1, 5, 0.02, "the new stream applied")
    assert depth(core, TOKENS) == 0


@pytest.mark.parametrize("frames", [
    [b"", b"short", b"x"],
    [b"", struct.pack(">Q", 1), b"\xc1"],
    [b"", struct.pack(">Q", 1), msgpack.packb({"not": "a batch"})],
    [b"only two", b"frames"],
])
def test_a_malformed_frame_is_counted_and_the_stream_goes_on(feed, frames):
    pub, core = feed
    pub.pub.send_multipart(frames)
    pub.send(0, [pub.stored([11], None, PAGES[0]), ["BlockStored", "bad hashes"]])
    wait_until(lambda: depth(core, TOKENS) == 1, 5, 0.02, "the good event applied")
    assert core.subscriber.num_malformed == 2  # the bad frame and the bad event
