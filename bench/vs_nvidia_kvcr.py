"""kvcr peer pulls against NVIDIA kvcr 0.1.1's hinted remote `deliver`, in the same run.

    .venv/bin/python bench/vs_nvidia_kvcr.py [--repeats 5]

NVIDIA kvcr is installed by this script into its own environment (`.venv-kvcr-ref`, without
torch: `--no-deps kvcr==0.1.1 nixl==1.5.0 nixl-cu12==1.5.0`). It runs its two instances in one
process (as its authors measured), UCX defaults. Ours: a source runner process and a pulling
process, shared memory (`UCX_TLS=sm,tcp`). Each repeat alternates one run of each system; a run
reports the median of 10 transfers after a warm-up, bytes checked every time.
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
REF_VENV = ROOT / ".venv-kvcr-ref"
REF_PACKAGES = [["--no-deps", "kvcr==0.1.1", "nixl==1.5.0", "nixl-cu12==1.5.0"],
                ["msgspec>=0.21,<1", "pyzmq>=25,<28", "numpy"]]


def reference_python() -> str:
    python = REF_VENV / "bin" / "python"
    if not (REF_VENV / ".installed").exists():
        print("  installing NVIDIA kvcr 0.1.1 into .venv-kvcr-ref ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(REF_VENV)], check=True)
        for args in REF_PACKAGES:
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                           check=True)
        (REF_VENV / ".installed").touch()
    return str(python)


def run_reference(python: str, pages: int, page_bytes: int, iterations: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # its own UCX defaults
    out = subprocess.run([python, str(ROOT / "bench" / "kvcr_ref_driver.py"), str(pages), str(page_bytes),
                          str(iterations)], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]  # NIXL logs to stdout too
    return statistics.median(json.loads(line)["seconds"])


def run_ours(pages: int, page_bytes: int, iterations: int, transport: str = "get") -> float:
    code = f"""
import json, statistics, sys
sys.path.insert(0, {str(ROOT)!r})
from bench.peer_pull import start_source
from pathlib import Path
import ctypes, os, tempfile, time
from kvcr.client import AttachedWriter, ControlClient
from kvcr.drivers.ucx_plane import UcxPlane
from kvcr.peer import Puller
from kvcr.proto.keys import request_page_hashes
pages, page_bytes, iterations = {pages}, {page_bytes}, {iterations}
with tempfile.TemporaryDirectory() as tmp:
    proc, info = start_source(Path(tmp), page_bytes, pages, dict(os.environ))
    try:
        control = info["endpoints"]["control"]
        keys = request_page_hashes(list(range(pages * 16)), 16)
        payload = [bytes([i % 251]) * page_bytes for i in range(pages)]
        with ControlClient(control) as client:
            while not client.info()["ucx"]["rkeys"]:
                time.sleep(0.05)
            w = AttachedWriter(client); w.put("kv", keys, payload); w.close()
        plane = UcxPlane(progress_thread=False)
        puller = Puller(plane, timeout_s=30, abandon_s=5, transport={transport!r})
        dest = ctypes.create_string_buffer(pages * page_bytes)
        dests = [ctypes.addressof(dest) + i * page_bytes for i in range(pages)]
        times = []
        for _ in range(iterations + 1):
            ctypes.memset(dest, 0, pages * page_bytes)
            t0 = time.perf_counter()
            assert puller.pull(control, "kv", keys, dests).delivered == pages
            times.append(time.perf_counter() - t0)
            assert ctypes.string_at(dest, pages * page_bytes) == b"".join(payload)
        puller.close(); plane.close()
        print(json.dumps({{"seconds": times[1:]}}))
    finally:
        proc.terminate(); proc.wait(15)
"""
    env = {**os.environ, "UCX_TLS": "sm,tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return statistics.median(json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])["seconds"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from bench.common import Spread, machine_line, publish, table

    python = reference_python()
    rows = []
    for pages, page_bytes in ((32, 1 << 20), (16, 64 << 10)):
        theirs, ours, same_host = [], [], []
        for i in range(max(5, args.repeats)):
            theirs.append(run_reference(python, pages, page_bytes, 10))
            ours.append(run_ours(pages, page_bytes, 10))
            same_host.append(run_ours(pages, page_bytes, 10, "shm"))
            print(f"\r  {pages} x {page_bytes >> 10} KiB: repeat {i + 1}", end="", flush=True)
        print()
        total = pages * page_bytes
        t_gbps = [total / t / 1e9 for t in theirs]
        o_gbps = [total / t / 1e9 for t in ours]
        s_gbps = [total / t / 1e9 for t in same_host]
        rows.append(f"| {pages} × {page_bytes >> 10} KiB | {Spread.of([t * 1e3 for t in theirs]).fmt()} ms "
                    f"({Spread.of(t_gbps).fmt()} GB/s) | {Spread.of([t * 1e3 for t in ours]).fmt()} ms "
                    f"({Spread.of(o_gbps).fmt()} GB/s) | "
                    f"{Spread.of([o / t for o, t in zip(o_gbps, t_gbps)]).fmt(1, 1)}x | "
                    f"{Spread.of([x * 1e3 for x in same_host]).fmt()} ms ({Spread.of(s_gbps).fmt()} GB/s) | "
                    f"{Spread.of([o / t for o, t in zip(s_gbps, t_gbps)]).fmt(1, 1)}x |")
        print(rows[-1])
    intro = (f"`python bench/vs_nvidia_kvcr.py --repeats {max(5, args.repeats)}` on {machine_line()}. NVIDIA "
             "kvcr 0.1.1 with NIXL 1.5.0 over UCX (its defaults), two instances in one process, hinted remote "
             "`deliver` (hint + deliver + completion). kvcr: `Puller.pull` (claim, GETs, release) from a source "
             "runner in another process over shared memory (UCX GETs, and `transfer = \"shm\"`: a copy from the "
             "source's pool mapped read-only, same host only). Each repeat runs all; each run is the median of 10 "
             "transfers after a warm-up, bytes checked every time. Median (min–max) over repeats.")
    publish("vs_nvidia_kvcr", "Against NVIDIA kvcr 0.1.1", intro,
            [table(["transfer", "NVIDIA kvcr 0.1.1", "kvcr (UCX GET)", "kvcr / NVIDIA",
                    "kvcr (same-host copy)", "same-host / NVIDIA"], rows)], write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
