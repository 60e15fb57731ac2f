"""A DiskTier of its own (lock, event list) and chains of pages for it: the NVMe tests' helpers."""

import random
import threading

from kvcr.drivers.nvme import DiskTier
from kvcr.proto.announce import announce_request
from kvcr.proto.disk_index import DiskIndex
from kvcr.proto.events import BlockStored
from kvcr.proto.keys import Namespace, request_page_hashes

BLOCK = 4
PAGE = 8192
NS = Namespace(model="org/model-x", tp_size=2, tp_rank=1, page_size=BLOCK)


def chain(n, seed=0):
    rng = random.Random(seed)
    tokens = [rng.randrange(30000) for _ in range(n * BLOCK)]
    return request_page_hashes(tokens, BLOCK), announce_request(tokens, BLOCK), \
        [rng.randbytes(PAGE) for _ in range(n)]


class Tier:
    """A DiskTier with its own lock and a list collecting the events it publishes."""

    def __init__(self, root, ns=NS, **kw):
        self.lock = threading.RLock()
        self.events = []
        self.index = DiskIndex(block_size=BLOCK, max_bytes=kw.pop("max_bytes", 0),
                               high_watermark=kw.pop("high", 1.0), low_watermark=kw.pop("low", 0.9))
        self.tier = DiskTier(root, ns, page_bytes=PAGE, index=self.index, lock=self.lock, flush=self._flush, **kw)

    def _flush(self):
        with self.lock:
            self.events.extend(self.index.take_events())

    def read(self, hexes):
        bufs = [bytearray(PAGE) for _ in hexes]
        n = self.tier.read_into(hexes, [memoryview(b) for b in bufs])
        return [bytes(b) for b in bufs[:n]]

    def stored(self):
        return [h for e in self.events if isinstance(e, BlockStored) for h in e.block_hashes]
