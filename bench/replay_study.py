"""Replay study: the four policies of `kvcr replay` on the synthetic trace, at 4 and 8 workers,
two DRAM capacities and arrival speed-ups 1x and 2x; plus the simulator's own speed.

    .venv/bin/python bench/replay_study.py [--requests 20000] [--trace FILE] [--no-write]

Then the trace's first requests through `kvcr router` + 2 `kvcr worker`s here, against the
simulation of that cluster. Baseline for reuse: the ideal single cache of the same total capacity (measured in the same
run); for TTFT: KV-aware routing without pulls.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Spread, machine_line, publish, table  # noqa: E402
from router_hints.replay.live import compare  # noqa: E402
from router_hints.replay.sim import POLICIES, SimConfig, simulate  # noqa: E402
from router_hints.replay.synth import SynthSpec, write  # noqa: E402
from router_hints.replay.trace import read_trace  # noqa: E402


LONG = SynthSpec(requests=10000, system_blocks=16, turn_blocks=(3, 12), max_turns=4)  # ~32 blocks a request
# The simulator's worst case, shaped like the start of Mooncake's conversation trace: one shared
# root block, then mostly blocks no request had before (~27 new of ~42 a request).
FRESH = SynthSpec(requests=10000, system_prompts=1, system_blocks=1, turn_blocks=(4, 50), max_turns=1)


def long_request_speed(spec: SynthSpec, repeats: int = 3) -> tuple[str, float]:
    """The simulator's speed per policy on a trace of long requests (8 workers of 1000 blocks),
    each policy run alone, as median (min-max) over repeats; and the trace's mean blocks per request."""
    path = Path(tempfile.mkdtemp(prefix="kvcr-replay-long-")) / "long.jsonl"
    write(path, spec)
    trace = read_trace(path)
    speeds: dict[str, list[int]] = {p: [] for p in POLICIES}
    for _ in range(repeats):
        for p, r in simulate(trace, SimConfig(workers=8, dram_blocks=1000), POLICIES).items():
            speeds[p].append(r.summary(0)["simulated_requests_per_s"])
    speed = ", ".join(f"{p} {Spread.of(v).fmt(digits=0)}" for p, v in speeds.items())
    return speed, sum(len(r.blocks) for r in trace) / len(trace)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--trace", help="a Mooncake-format trace instead of the synthetic one")
    parser.add_argument("--capacities", default="250,1000", help="DRAM blocks per worker")
    parser.add_argument("--live-requests", type=int, default=300)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--no-live", action="store_true", help="the simulation only (implies --no-write)")
    args = parser.parse_args()
    if args.trace:
        path = Path(args.trace)
    else:
        path = Path(tempfile.mkdtemp(prefix="kvcr-replay-")) / "synthetic.jsonl"
        write(path, SynthSpec(requests=args.requests))
    trace = read_trace(path)
    rows, speeds = [], {p: [] for p in POLICIES}
    for workers in (4, 8):
        for capacity in (int(c) for c in args.capacities.split(",")):
            for speedup in (1.0, 2.0):
                cfg = SimConfig(workers=workers, dram_blocks=capacity, speedup=speedup)
                res = {p: r.summary(cfg.block_bytes) for p, r in simulate(trace, cfg, POLICIES).items()}
                for p, s in res.items():
                    speeds[p].append(s["simulated_requests_per_s"])
                ideal, kv, kvcr = res["ideal"], res["kv"], res["kvcr"]
                row = (f"| {workers} | {capacity} | {speedup:g}x | " + " | ".join(
                    f"{res[p]['reuse']:.1%} / {res[p]['ttft_mean_s']:.2f} s" for p in POLICIES) +
                    f" | {kvcr['reuse'] / ideal['reuse']:.1%} | {kvcr['ttft_mean_s'] / kv['ttft_mean_s']:.2f} |")
                rows.append(row)
                print(row, flush=True)
    speed = ", ".join(f"{p} {sorted(v)[len(v) // 2]:,}" for p, v in speeds.items())
    long_speed, long_blocks = long_request_speed(LONG)
    print(f"simulated requests/s, long requests ({long_blocks:.1f} blocks each on average): {long_speed}")
    fresh_speed, fresh_blocks = long_request_speed(FRESH)
    print(f"simulated requests/s, mostly new blocks ({fresh_blocks:.1f} blocks each on average): {fresh_speed}")
    if args.no_live:
        print(f"simulated requests/s: {speed}")
        return 0
    # The live check: the trace's first requests through kvcr router, then Dynamo's frontend, each
    # in front of 2 kvcr workers on this machine; then live SGLang engines behind kvcr router, with
    # 8 requests in flight and with one (the simulation serves each request before the next).
    live_rows = []
    runs = (("kvcr", "kvcr", 8, "kvcr router"), ("dynamo", "kvcr", 8, "Dynamo's frontend"),
            ("kvcr", "sglang", 8, "kvcr router + live SGLang, 8 in flight"),
            ("kvcr", "sglang", 1, "kvcr router + live SGLang, 1 in flight"))
    for router, engine, concurrency, name in runs:
        live = compare(trace[:args.live_requests], SimConfig(workers=2, dram_blocks=200, speedup=10.0),
                       page_size=16, router=router, engine=engine, concurrency=concurrency)
        m = live["measured"]
        live_rows.append(f"| {name}: {live['requests']} requests, 2 workers x {live['pages_per_worker']} pages, 10x | "
                         f"{m['reuse']:.1%} (DRAM {m['reuse_by_tier']['dram']:.1%}, peer "
                         f"{m['reuse_by_tier']['peer']:.1%}) | {live['simulated']['reuse']:.1%} | "
                         f"{live['reuse_live_over_simulated']:.2f} | "
                         f"{'/'.join(map(str, m['requests_by_worker'].values()))} vs "
                         f"{'/'.join(map(str, live['simulated']['requests_by_worker']))} | {m['errors']} |")
        print(live_rows[-1], flush=True)
    source = f"`{args.trace}`" if args.trace else f"the synthetic trace ({args.requests} requests, seed 0)"
    intro = (f"`python bench/replay_study.py --requests {args.requests}` on {machine_line()}, {source}; "
             "defaults otherwise (8000 prefill tokens/s per worker, 512-token blocks of 64 MiB, 25 GB/s pulls). "
             "Each cell: fraction of prefix blocks reused / mean TTFT of the queueing model. Ratios against the "
             "ideal single cache (reuse) and KV-aware routing without pulls (TTFT), from the same run. "
             f"Simulator speed, median simulated requests/s per run: {speed}; on a synthetic trace of long requests "
             f"({long_blocks:.1f} blocks each on average, `LONG` in the script, 8 workers of 1000 blocks; median (min-max) of "
             f"3 runs): {long_speed}; the worst case, mostly blocks no request had before ({fresh_blocks:.1f} "
             f"blocks each, about 27 of them new, `FRESH` in the script): {fresh_speed}. "
             "The second table: the trace's first "
             f"{args.live_requests} requests through `kvcr router`, then Dynamo 1.6.1's unmodified frontend and KV "
             "router, each in front of 2 `kvcr worker`s on this machine, then `kvcr router` in front of 2 live "
             "SGLang 0.5.23 engines with kvcr's backend (CPU harness, tiny model) with 8 and with 1 request in "
             "flight (one 16-token page per block, DRAM only, arrivals 10x faster) against the simulation of that "
             "same cluster (with one request in flight, each is served before the next is sent, so the simulated "
             "workers prefill instantly and routing sees no load, as the live router does). "
             "Method: docs/replay.md.")
    columns = ["workers", "DRAM blocks each", "speed-up", *POLICIES, "kvcr reuse / ideal", "kvcr TTFT / kv TTFT"]
    live_columns = ["live run", "reuse measured", "reuse simulated (same cluster)", "measured / simulated",
                    "requests per worker, live vs simulated", "errors"]
    publish("replay", "Replay study: kvcr against the alternatives on a trace", intro,
            [table(columns, rows), table(live_columns, live_rows)], write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
