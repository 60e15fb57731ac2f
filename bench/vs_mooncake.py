"""kvcr peer pulls against Mooncake's Transfer Engine and Mooncake Store, in the same run, over TCP.

    .venv/bin/python bench/vs_mooncake.py [--repeats 5]

Mooncake is installed by this script into its own environment (`.venv-mooncake`:
`mooncake-transfer-engine-non-cuda==0.3.13.post1`, the wheel that imports without CUDA; it links
Debian's `libibverbs1`, which `make bench` installs). Its traffic stays on loopback
(`MC_TCP_BIND_ADDRESS`). Driven by bench/mooncake_driver.py: the Transfer Engine's
`batch_transfer_sync_read` from a source process, and Store `batch_get_into` by a client holding no
segment from a putter's segment (a true peer read). Ours: `Puller.pull` (claim, UCX GETs, release)
from a source runner process, `UCX_TLS=tcp`. Each repeat runs every system once, in turn; each run
is the median of 10 transfers after a warm-up into one of 4 destination copies, bytes checked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import Spread, machine_line, managed_venv, publish, table  # noqa: E402
from bench.kvcr_side import measure, run_ours  # noqa: E402
from kvcr.config import DEFAULT_INLINE_PULL_BYTES  # noqa: E402

MOONCAKE_VENV = ROOT / ".venv-mooncake"
MOONCAKE_PACKAGES = [["mooncake-transfer-engine-non-cuda==0.3.13.post1"]]
SIZES = ((32, 1 << 20), (16, 64 << 10), (8, 16 << 10))


def run_mooncake(python: str, mode: str, pages: int, page_bytes: int, iterations: int = 10) -> float:
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    out = subprocess.run([python, str(ROOT / "bench" / "mooncake_driver.py"), mode, str(pages), str(page_bytes),
                          str(iterations)], env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"mooncake {mode}: {out.stderr[-3000:]}")
    return statistics.median(json.loads(lines[-1])["seconds"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    python = managed_venv(MOONCAKE_VENV, MOONCAKE_PACKAGES, "Mooncake 0.3.13.post1 (non-CUDA)")

    def cell(runs: dict[str, list[float]], key: str, total: int) -> str:
        return (f"{Spread.of([t * 1e3 for t in runs[key]]).fmt()} ms "
                f"({Spread.of([total / t / 1e9 for t in runs[key]]).fmt()} GB/s)")

    def ratio(runs: dict[str, list[float]], theirs: str) -> str:
        return f"{Spread.of([t / o for o, t in zip(runs['kvcr'], runs[theirs])]).fmt(1, 2)}x"

    rows, chart = [], {}
    for pages, page_bytes in SIZES:
        runs: dict[str, list[float]] = measure(args.repeats, pages, page_bytes, {
            "te": lambda p, b: run_mooncake(python, "te", p, b),
            "store": lambda p, b: run_mooncake(python, "store", p, b),
            "kvcr": lambda p, b: run_ours(p, b, 10, "get", tls="tcp"),
            # the same pull made to claim, GET and release whatever its size: what the default replaces
            "gets": lambda p, b: run_ours(p, b, 10, "get", tls="tcp", inline_max=0)})
        total = pages * page_bytes
        how = "bytes in the claim's answer" if total <= DEFAULT_INLINE_PULL_BYTES else "claim, GETs, release"
        rows.append(f"| {pages} × {page_bytes >> 10} KiB | {cell(runs, 'te', total)} | {cell(runs, 'store', total)} | "
                    f"{cell(runs, 'kvcr', total)} ({how}) | {cell(runs, 'gets', total)} | {ratio(runs, 'te')} | "
                    f"{ratio(runs, 'store')} | {ratio(runs, 'gets')} |")
        print(rows[-1])
        chart[f"{pages} × {page_bytes >> 10} KiB"] = {
            label: [total / t / 1e9 for t in runs[key]]
            for key, label in (("te", "Mooncake TE"), ("store", "Mooncake Store"), ("kvcr", "kvcr (default)"),
                               ("gets", "kvcr claim + GETs"))}
    intro = (f"`python bench/vs_mooncake.py --repeats {args.repeats}` on {machine_line()}. Mooncake 0.3.13.post1 "
             "(non-CUDA wheel) over TCP on loopback: the Transfer Engine's `batch_transfer_sync_read` from a source "
             "process (peer-to-peer handshake), and Mooncake Store's `batch_get_into` by a client without a segment "
             "from a putter's segment. kvcr: `Puller.pull` from a source runner process, "
             "`UCX_TLS=tcp`, as shipped: a pull of at most `runner.inline_pull_bytes` (128 KiB) takes its bytes in the "
             "claim's answer, a larger one claims, GETs and releases; *claim + GETs* is the same pull made to take the "
             "second path whatever its size, in the same repeats. Each repeat runs every system once, in turn; each run is the median of 10 transfers after "
             "a warm-up, bytes checked. Median (min–max) over repeats; a ratio above 1 means kvcr is faster "
             "(their time / ours, per repeat).")
    publish("vs_mooncake", "Against Mooncake (Transfer Engine and Store), over TCP", intro,
            [table(["transfer", "Mooncake TE read", "Mooncake Store get", "kvcr", "kvcr, claim + GETs", "TE / kvcr",
                    "Store / kvcr", "claim + GETs / kvcr"], rows)], write=not args.no_write, chart=chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
