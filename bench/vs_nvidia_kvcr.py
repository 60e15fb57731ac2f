"""kvcr peer pulls against NVIDIA kvcr 0.1.1's hinted remote `deliver`, in the same run.

    .venv/bin/python bench/vs_nvidia_kvcr.py [--repeats 5]

NVIDIA kvcr is installed by this script into its own environment (`.venv-kvcr-ref`, without
torch: `--no-deps kvcr==0.1.1 nixl==1.5.0 nixl-cu12==1.5.0`). It runs its two instances in one
process (as its authors measured) and with its source in a child process, UCX defaults. Ours: a
source runner process and a pulling process, shared memory (`UCX_TLS=sm,tcp`). Each repeat
alternates one run of each; a run reports the median of 10 transfers after a warm-up, bytes checked
every time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import managed_venv  # noqa: E402
from bench.kvcr_side import measure, run_memcpy, run_ours  # noqa: E402
REF_VENV = ROOT / ".venv-kvcr-ref"
REF_PACKAGES = [["--no-deps", "kvcr==0.1.1", "nixl==1.5.0", "nixl-cu12==1.5.0"],
                ["msgspec>=0.21,<1", "pyzmq>=25,<28", "numpy"]]


def reference_python() -> str:
    return managed_venv(REF_VENV, REF_PACKAGES, "NVIDIA kvcr 0.1.1")


def run_reference(python: str, pages: int, page_bytes: int, iterations: int, processes: int = 2,
                  tls: str = "") -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # its own UCX defaults...
    if tls:  # ...but for the transports
        env.update(UCX_TLS=tls, UCX_NET_DEVICES="lo")
    out = subprocess.run([python, str(ROOT / "bench" / "kvcr_ref_driver.py"), str(pages), str(page_bytes),
                          str(iterations), str(processes)], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]  # NIXL logs to stdout too
    return statistics.median(json.loads(line)["seconds"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from bench.common import Spread, machine_line, publish, table
    from kvcr.drivers.memcopy import Copier, default_threads

    python = reference_python()
    repeats = max(5, args.repeats)

    def cells(runs: dict[str, list[float]], total: int) -> Callable[[str], str]:
        return lambda key: (f"{Spread.of([t * 1e3 for t in runs[key]]).fmt()} ms "
                            f"({Spread.of([total / t / 1e9 for t in runs[key]]).fmt()} GB/s)")

    def ratio(runs: dict[str, list[float]], ours: str, theirs: str) -> str:
        return f"{Spread.of([t / o for o, t in zip(runs[ours], runs[theirs])]).fmt(1, 1)}x"

    def share(runs: dict[str, list[float]], ours: str, limit: str) -> str:
        return f"{Spread.of([t / o for o, t in zip(runs[ours], runs[limit])]).fmt(100, 0)} %"

    shm_rows, tcp_rows, chart = [], [], {}
    copy_threads = default_threads()  # plain memcpy gets as many threads as kvcr's same-host copy
    labels = {"nv2": "NVIDIA, 2 processes", "nv1": "NVIDIA, 1 process", "get": "kvcr UCX GET",
              "shm": "kvcr same-host copy", "memcpy": f"memcpy, {copy_threads} threads"}

    def plot(group: str, runs: dict[str, list[float]], total: int) -> None:
        chart[group] = {labels[k]: [total / t / 1e9 for t in v] for k, v in runs.items()}

    for pages, page_bytes in ((32, 1 << 20), (16, 64 << 10)):
        runs = measure(repeats, pages, page_bytes, {
            "nv2": lambda p, b: run_reference(python, p, b, 10, processes=2),
            "nv1": lambda p, b: run_reference(python, p, b, 10, processes=1),
            "get": lambda p, b: run_ours(p, b, 10, "get"),
            "shm": lambda p, b: run_ours(p, b, 10, "shm"),
            "memcpy": lambda p, b: run_memcpy(p, b, 10, copy_threads)})
        cell = cells(runs, pages * page_bytes)
        shm_rows.append(f"| {pages} × {page_bytes >> 10} KiB | {cell('nv2')} | {cell('nv1')} | {cell('get')} | "
                        f"{cell('shm')} | {cell('memcpy')} | {ratio(runs, 'shm', 'nv2')} | {ratio(runs, 'shm', 'nv1')} | "
                        f"{ratio(runs, 'get', 'nv2')} | {share(runs, 'shm', 'memcpy')} |")
        print(shm_rows[-1])
        plot(f"shared memory, {pages} × {page_bytes >> 10} KiB", runs, pages * page_bytes)
    for pages, page_bytes in ((32, 1 << 20),):
        runs = measure(repeats, pages, page_bytes, {
            "nv2": lambda p, b: run_reference(python, p, b, 10, processes=2, tls="tcp"),
            "get": lambda p, b: run_ours(p, b, 10, "get", tls="tcp")})
        cell = cells(runs, pages * page_bytes)
        tcp_rows.append(f"| {pages} × {page_bytes >> 10} KiB | {cell('nv2')} | {cell('get')} | "
                        f"{ratio(runs, 'get', 'nv2')} |")
        print(tcp_rows[-1])
        plot(f"TCP, {pages} × {page_bytes >> 10} KiB", runs, pages * page_bytes)
    copier = Copier()
    intro = (f"`python bench/vs_nvidia_kvcr.py --repeats {repeats}` on {machine_line()}. NVIDIA kvcr 0.1.1 with "
             "NIXL 1.5.0 over UCX (its defaults), hinted remote `deliver` (hint + deliver + completion): its source "
             "instance in a process of its own (the setting the target names, and ours), and both instances in one "
             "process (as its authors measured). kvcr: `Puller.pull` (claim, transfer, release) from a source runner "
             "process: UCX GETs, and the same-host copy (`transfer = \"shm\"`, what `auto` picks on one host: the "
             f"source's pool mapped read-only, {copier.threads} copy threads, non-temporal stores "
             f"{'on' if copier.streams else 'off (no C helper)'}). Each repeat runs every system once, in turn; each "
             "run is the median of 10 transfers after a warm-up into one of 4 destination copies used in turn, bytes "
             "checked every time (memcmp and memset: nothing allocated). The physical limit on one host, in the "
             f"same run: plain memcpy (glibc, {copy_threads} threads) of the same bytes from a pre-faulted shared-memory "
             "file into the same rotation of destinations; the last column is its time over the whole same-host pull "
             "(claim round trip included). Median (min–max) over repeats; ratios are per repeat.")
    copier.close()
    publish("vs_nvidia_kvcr", "Against NVIDIA kvcr 0.1.1", intro,
            [["Shared memory (`UCX_TLS=sm,tcp` for kvcr, UCX's own choice for NVIDIA kvcr):"],
             table(["transfer", "NVIDIA, 2 processes", "NVIDIA, 1 process", "kvcr UCX GET", "kvcr same-host copy",
                    labels["memcpy"], "same-host / NVIDIA 2p", "same-host / NVIDIA 1p", "UCX GET / NVIDIA 2p",
                    "same-host pull / memcpy"], shm_rows),
             ["TCP (`UCX_TLS=tcp` for both, loopback):"],
             table(["transfer", "NVIDIA, 2 processes", "kvcr UCX GET", "kvcr / NVIDIA"], tcp_rows)],
            write=not args.no_write, chart=chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
