"""Router overhead per request: page hashing + index match + scoring + source hint.

    .venv/bin/python bench/router_overhead.py [--workers 16]

An index holding, for every worker, a random-length prefix of a shared 32k-token document (in a
random tier); requests of 8k and 32k tokens of that document. Measured: `RouterCore.route`
(content hashes of the request's blocks, per-worker overlaps, Dynamo's cost for every worker,
the hint envelope from the best peer), 500 requests each, p50/p99.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_line, publish, table  # noqa: E402
from kvcr.proto.announce import announce_request  # noqa: E402
from kvcr.proto.events import EventBatch  # noqa: E402
from kvcr.proto.pool import coalesce_announces  # noqa: E402
from router_hints.core import RouterCore  # noqa: E402
from router_hints.discovery import Publisher  # noqa: E402

BLOCK = 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rng = random.Random(0)
    doc = [rng.randrange(100_000) for _ in range(2048 * BLOCK)]
    announces = announce_request(doc, BLOCK)
    core = RouterCore(block_size=BLOCK)
    for w in range(args.workers):
        # Publishers are registered without connecting anywhere: only the index and scoring are timed.
        core.publishers[(str(w), 0)] = Publisher(str(w), 0, BLOCK, "", None, f"tcp://127.0.0.1:{9000 + w}")
        depth, medium = rng.randrange(1, 2049), rng.choice(["GPU", "CPU_PINNED", "CPU_TIER1", "DISK"])
        for start in range(0, depth, 64):
            ann = announces[start:min(depth, start + 64)]
            core.index.apply(str(w), EventBatch(ts=0.0, dp_rank=0,
                                                events=tuple(coalesce_announces(ann, BLOCK, medium))))
    rows = []
    for tokens in (8192, 32768):
        request = doc[:tokens]
        times = []
        for _ in range(args.requests):
            t0 = time.perf_counter()
            core.route(request)
            times.append(time.perf_counter() - t0)
        times.sort()
        rows.append(f"| {tokens // 1024}k | {tokens // BLOCK} | {statistics.median(times) * 1e3:.3f} | "
                    f"{times[int(len(times) * 0.99) - 1] * 1e3:.3f} |")
        print(rows[-1])
    intro = (f"`python bench/router_overhead.py --workers {args.workers}` on {machine_line()}: `RouterCore.route` "
             f"over {args.workers} workers each holding a random prefix of one 32k-token document in a random "
             f"tier; {args.requests} requests per size. It includes hashing the request's blocks (XXH3, chained), "
             "the per-tier match, Dynamo's cost for every worker and the hint envelope. No network.")
    publish("router_overhead", "Router overhead per request", intro,
            [table(["request", "blocks", "p50 ms", "p99 ms"], rows)], write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
