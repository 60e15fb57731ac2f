"""Router index ingest and prefix match against Dynamo's Rust RadixTree, fed the same events.

    .venv/bin/python bench/router_index.py [--repeats 5] [--workers 64]

Workload: W workers, each holding a random prefix (in a random tier) of two of eight 32k-token
documents, announced in events of 32 blocks (16 tokens each). Ours: InventoryIndex.apply on the
decoded batches (it hashes the tokens itself, as Dynamo's indexer does before its tree). Rust:
`dynamo._core.RadixTree.apply_event` on the same events with the token hashes precomputed (its
Python binding takes them), in Dynamo's own environment. Match: one 32k-token request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Spread, machine_line, publish, table  # noqa: E402
from kvcr.proto.announce import announce_request  # noqa: E402
from kvcr.proto.events import EventBatch  # noqa: E402
from kvcr.proto.pool import coalesce_announces  # noqa: E402
from kvcr.proto.tokenhash import dynamo_local_block_hashes  # noqa: E402
from router_hints.index import InventoryIndex  # noqa: E402

BLOCK, DOC_BLOCKS, PER_EVENT = 16, 2048, 32
# our media -> Dynamo's storage tiers: it reads both the engine's host pool and a runner's DRAM as host
TIER = {"GPU": "device", "CPU_PINNED": "host_pinned", "CPU_TIER1": "host_pinned", "DISK": "disk"}


def workload(workers: int, seed: int = 0):
    rng = random.Random(seed)
    docs = [[rng.randrange(100_000) for _ in range(DOC_BLOCKS * BLOCK)] for _ in range(8)]
    announces = [announce_request(d, BLOCK) for d in docs]
    local = [dynamo_local_block_hashes(d, BLOCK) for d in docs]
    ours, rust = [], []
    for w in range(workers):
        for doc in rng.sample(range(8), 2):
            depth, medium = rng.randrange(PER_EVENT, DOC_BLOCKS + 1), rng.choice(list(TIER))
            for start in range(0, depth, PER_EVENT):
                ann = announces[doc][start:min(depth, start + PER_EVENT)]
                ours.append((str(w), EventBatch(ts=0.0, dp_rank=0,
                                                events=tuple(coalesce_announces(ann, BLOCK, medium)))))
                rust.append([w, json.dumps({"event_id": len(rust), "dp_rank": 0, "storage_tier": TIER[medium],
                                            "data": {"stored": {"parent_hash": ann[0].parent_hash and
                                                                ann[0].parent_hash & (2**64 - 1),
                                                                "blocks": [{"block_hash": a.event_hash & (2**64 - 1),
                                                                            "tokens_hash": h} for a, h in
                                                                           zip(ann, local[doc][start:])]}}})])
    return ours, rust, docs[0], local[0]


def run_ours(events, query_tokens, repeats: int) -> tuple[float, list[float], int]:
    index = InventoryIndex(block_size=BLOCK)
    t0 = time.perf_counter()
    for worker, batch in events:
        index.apply(worker, batch)
    ingest = time.perf_counter() - t0
    seq = index.sequence_hashes(query_tokens)
    matches = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        overlaps = index.overlaps(seq)
        matches.append(time.perf_counter() - t0)
    return ingest, matches, len(overlaps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    python = os.environ.get("KVCR_DYNAMO_PYTHON", str(ROOT / ".venv-dynamo" / "bin" / "python"))
    ours_events, rust_events, query_tokens, query_local = workload(args.workers)
    blocks = sum(len(b.events[0].block_hashes) for _, b in ours_events)
    ingest_ours, ingest_rust, match_ours, match_rust = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "events.jsonl").write_text("\n".join(json.dumps(e) for e in rust_events))
        (Path(tmp) / "query.json").write_text(json.dumps(query_local))
        for i in range(max(5, args.repeats)):
            out = subprocess.run([python, str(ROOT / "bench" / "radix_driver.py"), str(Path(tmp) / "events.jsonl"),
                                  str(Path(tmp) / "query.json"), "200"], capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise SystemExit(out.stderr[-2000:])
            rust = json.loads(out.stdout.strip().splitlines()[-1])
            ingest_rust.append(blocks / rust["ingest_s"])
            match_rust += rust["match_s"]
            ingest, matches, matched = run_ours(ours_events, query_tokens, 200)
            ingest_ours.append(blocks / ingest)
            match_ours += matches
            print(f"\r  repeat {i + 1}: {matched} workers matched (Rust: {rust['workers_matched']})", end="",
                  flush=True)
    print()

    def p99(xs: list[float]) -> float:
        return sorted(xs)[int(len(xs) * 0.99) - 1] * 1e3

    p50_ours, p50_rust = statistics.median(match_ours) * 1e3, statistics.median(match_rust) * 1e3
    rows = [f"| ingest (blocks/s) | {Spread.of(ingest_ours).fmt(1e-3, 0)} k | "
            f"{Spread.of(ingest_rust).fmt(1e-3, 0)} k | "
            f"{Spread.of([o / r for o, r in zip(ingest_ours, ingest_rust)]).fmt(1, 2)}x |",
            f"| match 32k tokens, p50 (ms) | {p50_ours:.3f} | {p50_rust:.3f} | {p50_rust / p50_ours:.2f}x |",
            f"| match 32k tokens, p99 (ms) | {p99(match_ours):.3f} | {p99(match_rust):.3f} | "
            f"{p99(match_rust) / p99(match_ours):.2f}x |"]
    for row in rows:
        print(row)
    intro = (f"`python bench/router_index.py --workers {args.workers}` on {machine_line()}: {args.workers} workers, "
             f"{len(ours_events)} events, {blocks} blocks (16 tokens each), each worker holding random prefixes of "
             "two of eight 32k-token documents in random tiers. Ours: `InventoryIndex.apply` on decoded batches "
             "(hashing the tokens itself; Python with two C helpers, the token hash and the per-block ingest loops, "
             f"{_native_state()}). Rust: Dynamo's `RadixTree.apply_event` (ai-dynamo-runtime 1.6.1) on "
             "the same events with token hashes precomputed. Match: one 32k-token request (2,048 blocks), 200 "
             "queries per repeat. Ingest is median (min–max) over repeats; ratios are ours/Rust (for latency, "
             "Rust/ours: above 1 means ours is faster).")
    publish("router_index", "Router index: ingest and match against Dynamo's RadixTree", intro,
            [table(["measure", "kvcr (Python + C)", "Dynamo RadixTree (Rust)", "ratio"], rows)],
            write=not args.no_write, unit="thousand blocks/s",
            chart={"ingest": {"kvcr (Python + C)": [x / 1e3 for x in ingest_ours],
                              "Dynamo RadixTree (Rust)": [x / 1e3 for x in ingest_rust]}})
    return 0


def _native_state() -> str:
    from kvcr.proto import tokenhash
    from router_hints import index
    built = tokenhash._native is not None and index._count_stored is not index._count_stored_py
    return "both built" if built else "not built on this host: all Python"


if __name__ == "__main__":
    sys.exit(main())
