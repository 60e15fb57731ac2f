"""kvcr's side of the same-run comparisons (bench/vs_nvidia_kvcr.py, bench/vs_mooncake.py).

`run_ours`: a source runner process and a pulling process; each run is the median of
`iterations` pulls after a warm-up into one of 4 destination copies used in turn (as the anchors'
drivers do), every byte checked. `run_memcpy`: plain memcpy of the same bytes, the same way.
`measure`: each repeat runs every system once, in turn.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROTATION = 4  # destination copies used in turn by every system


def run_ours(pages: int, page_bytes: int, iterations: int, transport: str = "get", tls: str = "sm,tcp",
             inline_max: int | None = None) -> float:
    """`inline_max`: the puller's `inline_max` (None: its default; 0: always claim, GET, release)."""
    code = f"""
import json, statistics, sys
sys.path.insert(0, {str(ROOT)!r})
from bench.peer_pull import start_filled_source
from pathlib import Path
import ctypes, os, tempfile, time
from kvcr.drivers.ucx_plane import UcxPlane
from kvcr.drivers.puller import Puller
pages, page_bytes, iterations, ROTATION = {pages}, {page_bytes}, {iterations}, {ROTATION}
with tempfile.TemporaryDirectory() as tmp:
    proc, control, keys, payload = start_filled_source(Path(tmp), page_bytes, pages, dict(os.environ))
    try:
        plane = UcxPlane(progress_thread=False)
        puller = Puller(plane, timeout_s=30, abandon_s=5, transport={transport!r}, local_control={tls != "tcp"},
                        trusted=frozenset({{control}}),  # a keyless source over TCP: trusted by name
                        **({{"inline_max": {inline_max}}} if {inline_max is not None} else {{}}))
        total = pages * page_bytes
        dest = ctypes.create_string_buffer(ROTATION * total)  # zeroed
        expected = ctypes.create_string_buffer(b"".join(payload), total)
        libc = ctypes.CDLL(None)
        libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        times = []
        for it in range(iterations + 1):
            base = ctypes.addressof(dest) + it % ROTATION * total  # not written just before (as theirs)
            t0 = time.perf_counter()
            assert puller.pull(control, "kv", keys, [base + i * page_bytes for i in range(pages)]).delivered == pages
            times.append(time.perf_counter() - t0)
            assert libc.memcmp(base, expected, total) == 0
            ctypes.memset(base, 0, total)  # checking and zeroing allocate nothing (as theirs)
        puller.close(); plane.close()
        print(json.dumps({{"seconds": times[1:]}}))
    finally:
        proc.terminate(); proc.wait(15)
"""
    env = {**os.environ, "UCX_TLS": tls, "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return statistics.median(json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])["seconds"])


def run_memcpy(pages: int, page_bytes: int, iterations: int, threads: int = 1) -> float:
    """The same bytes copied with plain memcpy (glibc's, through ctypes, which lets go of the GIL)
    from a pre-faulted shared-memory file, as a source runner's pool is, into the same rotation of
    destinations, checked and zeroed as in run_ours: the physical limit of a same-host pull. With
    `threads`, the bytes are split evenly over that many threads."""
    code = f"""
import ctypes, json, mmap, os, tempfile, time
from concurrent.futures import ThreadPoolExecutor
pages, page_bytes, iterations, ROTATION, threads = {pages}, {page_bytes}, {iterations}, {ROTATION}, {threads}
total = pages * page_bytes
fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvcr-bench-memcpy-")
os.ftruncate(fd, total)
src = mmap.mmap(fd, total)
os.unlink(path); os.close(fd)
src[:] = b"".join(bytes([i % 251]) * page_bytes for i in range(pages))
src_addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
dest = ctypes.create_string_buffer(ROTATION * total)
libc = ctypes.CDLL(None)
libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
share = total // threads
pool = ThreadPoolExecutor(threads)
times = []
for it in range(iterations + 1):
    base = ctypes.addressof(dest) + it % ROTATION * total
    t0 = time.perf_counter()
    list(pool.map(lambda k: ctypes.memmove(base + k * share, src_addr + k * share,
                                           share if k < threads - 1 else total - k * share), range(threads)))
    times.append(time.perf_counter() - t0)
    assert libc.memcmp(base, src_addr, total) == 0
    ctypes.memset(base, 0, total)
print(json.dumps({{"seconds": times[1:]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return statistics.median(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def measure(repeats: int, pages: int, page_bytes: int, systems: dict) -> dict[str, list[float]]:
    """Each repeat runs every system once, in turn; returns seconds per system."""
    runs: dict[str, list[float]] = {name: [] for name in systems}
    for i in range(repeats):
        for name, run in systems.items():
            runs[name].append(run(pages, page_bytes))
        print(f"\r  {pages} x {page_bytes >> 10} KiB: repeat {i + 1}/{repeats}", end="", flush=True)
    print()
    return runs
