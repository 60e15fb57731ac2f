"""Self-check (`kvcr selfcheck`): store pages in a running runner and read them back byte for byte."""

from __future__ import annotations

import random
import sys
import time

from .client import AttachedWriter, ControlClient
from .proto.announce import announce_request
from .proto.keys import request_page_hashes


def run_selfcheck(control: str, *, pages: int = 64, seed: int = 0, out=sys.stderr) -> int:
    with ControlClient(control) as client:
        writer = AttachedWriter(client)
        try:
            pool = writer.info["pools"][0]
            block = writer.info["block_size"]
            rng = random.Random(seed)
            tokens = [rng.randrange(32000) for _ in range(pages * block)]
            keys = request_page_hashes(tokens, block)
            announces = announce_request(tokens, block, event_format=writer.info["event_format"])
            data = [rng.randbytes(pool["page_bytes"]) for _ in range(pages)]
            t0 = time.perf_counter()
            stored = writer.put(pool["name"], keys, data, announces)
            back = writer.get(pool["name"], keys)
            took = time.perf_counter() - t0
        finally:
            writer.close()
    same = sum(1 for a, b in zip(data, back) if a == b)
    print(f"selfcheck: stored {stored}/{pages} pages of {pool['page_bytes']} bytes, read back {len(back)}, "
          f"{same} identical ({took * 1000:.1f} ms)", file=out)
    return 0 if stored == pages and same == pages else 1
