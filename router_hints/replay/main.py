"""`kvcr replay`: read a trace, simulate the policies side by side, print tables, write
replay.json and charts. The I/O around sim.py."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

from .sim import POLICIES, SimConfig, simulate
from .synth import SynthSpec
from .synth import write as write_synthetic
from .trace import MOONCAKE_BLOCK_TOKENS, TraceError, read_trace

LABELS = {"round_robin": "round-robin", "kv": "KV-aware, no pulls", "kvcr": "kvcr (hints + pulls)",
          "ideal": "ideal single cache"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", help="Mooncake FAST'25 JSONL (hash_ids) or token-ids JSONL")
    p.add_argument("--synthetic", type=int, metavar="N",
                   help="no trace given: generate N requests (fixed seed) into the output directory first")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--capacity-blocks", type=int, default=4000, help="DRAM blocks per worker")
    p.add_argument("--nvme-blocks", type=int, default=0, help="NVMe blocks per worker (0: none)")
    p.add_argument("--prefill-rate", type=float, default=8000.0, help="prefill tokens/s per worker")
    p.add_argument("--decode-rate", type=float, default=0.0, help="decode tokens/s per worker (0: not modelled)")
    p.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS, help="tokens per trace block")
    p.add_argument("--kv-bytes-per-token", type=int, default=131072)
    p.add_argument("--link-gbps", type=float, default=25.0, help="GB/s of a peer pull")
    p.add_argument("--claim-rtt-ms", type=float, default=0.5)
    p.add_argument("--speedup", type=float, default=1.0, help="replay arrivals this many times faster")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {','.join(POLICIES)}")
    p.add_argument("--sweep-capacity", help="comma-separated DRAM capacities: reuse vs capacity chart")
    p.add_argument("--out", default="replay-out", help="directory for replay.json and the charts")
    p.add_argument("--json", help="also write the results JSON here")
    p.add_argument("--no-charts", action="store_true")
    p.add_argument("--live", action="store_true",
                   help="also drive the trace's first --live-requests through `kvcr router` + `kvcr worker`s here "
                        "(one page of --page-size tokens per block, DRAM of --capacity-blocks pages, no NVMe) and "
                        "compare with the simulation of the same cluster")
    p.add_argument("--live-requests", type=int, default=200)
    p.add_argument("--live-router", default="kvcr", choices=("kvcr", "dynamo"),
                   help="live: our router, or Dynamo 1.6.1's unmodified frontend and KV router (make dynamo-setup)")
    p.add_argument("--live-engine", default="kvcr", choices=("kvcr", "sglang"),
                   help="live: `kvcr worker`s, or live SGLang engines with kvcr's backend (make sglang-setup; "
                        "the CPU harness's tiny model; behind kvcr router only)")
    p.add_argument("--live-concurrency", type=int, default=8,
                   help="live: requests in flight at most (1: each served before the next, as the simulation)")
    p.add_argument("--page-size", type=int, default=16, help="live: tokens per KV page (one per trace block)")


def config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(workers=args.workers, dram_blocks=args.capacity_blocks, nvme_blocks=args.nvme_blocks,
                     prefill_tokens_per_s=args.prefill_rate, decode_tokens_per_s=args.decode_rate,
                     block_tokens=args.block_tokens, kv_bytes_per_token=args.kv_bytes_per_token,
                     link_gbps=args.link_gbps, claim_rtt_s=args.claim_rtt_ms / 1000.0, speedup=args.speedup)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        policies = _policies(args.policies)
        if args.live:
            from .live import check_options

            check_options(router=args.live_router, engine=args.live_engine, concurrency=args.live_concurrency)
        cfg = config(args)
        sweep = [int(c) for c in args.sweep_capacity.split(",")] if args.sweep_capacity else []
        trace_path = _trace_path(args, out)
        trace = read_trace(trace_path, block_tokens=args.block_tokens)
    except (TraceError, ValueError) as exc:
        print(f"kvcr replay: {exc}", file=sys.stderr)
        return 2
    console.print(f"{len(trace)} requests from {trace_path}; {cfg.workers} workers x {cfg.dram_blocks} DRAM + "
                  f"{cfg.nvme_blocks} NVMe blocks, {cfg.prefill_tokens_per_s:g} prefill tokens/s, speed-up "
                  f"{cfg.speedup:g}x")
    runs = [(cfg, policies)] + [(replace(cfg, dram_blocks=c), policies) for c in sweep if c != cfg.dram_blocks]
    with Progress(console=console, transient=True) as bar:
        tasks = {}

        def progress(policy: str, n: int, label: str = "") -> None:
            bar.advance(tasks[(label, policy)], n)

        results = []
        for run_cfg, run_policies in runs:
            label = f"C={run_cfg.dram_blocks}"
            for p in run_policies:
                tasks[(label, p)] = bar.add_task(f"{label} {LABELS[p]}", total=len(trace))
            results.append((run_cfg, simulate(trace, run_cfg, run_policies,
                                              lambda p, n, label=label: progress(p, n, label))))
    main_cfg, main = results[0]
    summary = {"trace": str(trace_path), "requests": len(trace), "config": _config_dict(main_cfg),
               "policies": {p: r.summary(main_cfg.block_bytes) for p, r in main.items()},
               "sweep": [{"capacity_blocks": c.dram_blocks,
                          "policies": {p: r.summary(c.block_bytes) for p, r in res.items()}}
                         for c, res in sorted(results, key=lambda x: x[0].dram_blocks)] if sweep else []}
    Console(width=max(Console().width, 150)).print(table(summary))  # the table is the result: stdout
    text = json.dumps(summary, indent=1)
    (out / "replay.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)
    if not args.no_charts:
        charts(summary, out)
    if args.live:
        summary["live"] = live_comparison(args, trace, console)
        text = json.dumps(summary, indent=1)
        (out / "replay.json").write_text(text)
        if args.json:
            Path(args.json).write_text(text)
    console.print(f"wrote {out / 'replay.json'}" + ("" if args.no_charts else f" and charts in {out}"))
    return 0


def live_comparison(args: argparse.Namespace, trace: list, console) -> dict:
    """The first --live-requests through the real stack, and the simulation of that cluster."""
    from rich.progress import Progress

    from .live import compare

    part = trace[:args.live_requests]
    with Progress(console=console, transient=True) as bar:
        router = "Dynamo's frontend" if args.live_router == "dynamo" else "kvcr router"
        workers = "live SGLang engines" if args.live_engine == "sglang" else "workers"
        task = bar.add_task(f"live: {len(part)} requests through {router} + {args.workers} {workers}", total=len(part))
        result = compare(part, config(args), page_size=args.page_size, run_dir=Path(args.out) / "live",
                         router=args.live_router, engine=args.live_engine, concurrency=args.live_concurrency,
                         progress=lambda n: bar.advance(task, n))
    live, predicted, agreement = result["measured"], result["simulated"], result["reuse_live_over_simulated"]
    console.print(f"live ({router}): reuse {live['reuse']:.1%} (DRAM {live['reuse_by_tier']['dram']:.1%}, peer "
                  f"{live['reuse_by_tier']['peer']:.1%}), simulation of the same cluster {predicted['reuse']:.1%}"
                  + (f": live / simulated {agreement:.2f}" if agreement is not None else "")
                  + f"; {live['errors']} errors, latency p50 {live['latency_p50_s']:.3f} s")
    return result


def _policies(raw: str) -> list[str]:
    names = [p.strip() for p in raw.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise ValueError(f"--policies: {', '.join(bad) or 'none given'}: choose from {', '.join(POLICIES)}")
    return names


def _trace_path(args: argparse.Namespace, out: Path) -> Path:
    if args.trace:
        return Path(args.trace)
    if not args.synthetic:
        raise ValueError("give a TRACE file, or --synthetic N to generate one")
    path = out / f"synthetic-{args.synthetic}.jsonl"
    write_synthetic(path, SynthSpec(requests=args.synthetic))
    return path


def _config_dict(cfg: SimConfig) -> dict:
    return {"workers": cfg.workers, "dram_blocks": cfg.dram_blocks, "nvme_blocks": cfg.nvme_blocks,
            "prefill_tokens_per_s": cfg.prefill_tokens_per_s, "decode_tokens_per_s": cfg.decode_tokens_per_s,
            "block_tokens": cfg.block_tokens, "block_bytes": cfg.block_bytes, "link_gbps": cfg.link_gbps,
            "claim_rtt_s": cfg.claim_rtt_s, "nvme_gbps": cfg.nvme_gbps, "speedup": cfg.speedup}


def table(summary: dict):
    from rich.table import Table

    t = Table(title=f"kvcr replay: {summary['requests']} requests, {summary['config']['workers']} workers")
    for col in ("policy", "reuse", "DRAM", "NVMe", "peer", "recomputed tokens", "pulled GiB", "TTFT p50 s",
                "TTFT p99 s", "TTFT mean s", "load imbalance"):
        t.add_column(col, justify="right")
    for p, s in summary["policies"].items():
        tiers = s["reuse_by_tier"]
        t.add_row(LABELS[p], f"{s['reuse']:.1%}", f"{tiers['dram']:.1%}", f"{tiers['nvme']:.1%}",
                  f"{tiers['peer']:.1%}", f"{s['recomputed_tokens']:,}", f"{s['pulled_bytes'] / 2**30:.1f}",
                  f"{s['ttft_p50_s']:.2f}", f"{s['ttft_p99_s']:.2f}", f"{s['ttft_mean_s']:.2f}",
                  f"{s['load_imbalance']:.2f}")
    return t


def charts(summary: dict, out: Path) -> None:
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols = summary["policies"]
    names = [LABELS[p] for p in pols]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = [0.0] * len(pols)
    for tier, color in (("dram", "#2b8cbe"), ("nvme", "#7bccc4"), ("peer", "#f03b20")):
        values = [s["reuse_by_tier"][tier] for s in pols.values()]
        axes[0].bar(names, values, bottom=bottom, label=tier, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[0].set_title("prefix blocks reused, by tier")
    axes[0].legend()
    for i, key in enumerate(("ttft_p50_s", "ttft_mean_s", "ttft_p99_s")):
        axes[1].bar([x + (i - 1) * 0.27 for x in range(len(pols))], [s[key] for s in pols.values()], width=0.27,
                    label=key.removeprefix("ttft_").removesuffix("_s"))
    axes[1].set_xticks(range(len(pols)), names)
    axes[1].set_title("TTFT (s), queueing model")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(out / "replay.png", dpi=100)
    plt.close(fig)
    if summary["sweep"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        caps = [row["capacity_blocks"] for row in summary["sweep"]]
        for p in pols:
            ax.plot(caps, [row["policies"][p]["reuse"] for row in summary["sweep"]], marker="o", label=LABELS[p])
        ax.set_xlabel("DRAM blocks per worker")
        ax.set_ylabel("prefix blocks reused")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "replay-capacity.png", dpi=100)
        plt.close(fig)
