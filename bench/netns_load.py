"""Many destinations pulling from one source across test hosts (network namespaces, root only).

    sudo .venv/bin/python bench/netns_load.py [--destinations 8 16 32] [--seconds 20] [--pages 16]

A source runner on h1 holds the pages; each destination is its own process (its own UCX worker)
on h2 or h3, pulling the same pages (claim, GETs over TCP on the veth, release) in a loop for a
fixed time. Baseline, in the same run: one destination alone. Reports pulls/s and GB/s in all,
p50/p99 of one pull, the source's claims outstanding (sampled), its resident memory before and
after (growth), and whether it still serves a fresh pull at the end. Writes docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine_line, write_section  # noqa: E402
from tests.netns import destroy_hosts, make_hosts, unavailable  # noqa: E402

PAGE = 64 << 10
TOKEN = "bench-netns-token-0123"

DESTINATION = r"""
import ctypes, json, sys, time
from kvcr.config import CurveKeys
from kvcr.drivers.ucx_plane import UcxPlane
from kvcr.drivers.puller import Puller
from tests.test_service import pages_for
control, pages, seconds, public, secret = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
keys, _, data = pages_for(pages, seed=1, page_bytes=%(page)d)
puller = Puller(UcxPlane(interface="eth0"), curve=CurveKeys(public.encode(), secret.encode(), frozenset()))
buf = ctypes.create_string_buffer(%(page)d * pages)
dests = [ctypes.addressof(buf) + i * %(page)d for i in range(pages)]
print("ready", flush=True)
sys.stdin.readline()  # everyone starts together
lat, short, end = [], 0, time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.perf_counter()
    got = puller.pull(control, "kv", keys, dests).delivered
    lat.append(time.perf_counter() - t0)
    short += got != pages
wrong = int(buf.raw[:%(page)d * pages] != b"".join(data))
print(json.dumps({"latencies": lat, "short": short, "wrong_last": wrong}), flush=True)
""" % {"page": PAGE}


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run_load(hosts, env, control: str, http: str, n: int, pages: int, seconds: float, keys) -> dict:
    procs = [subprocess.Popen([*hosts[1 + i % 2].wrap(), sys.executable, "-c", DESTINATION, control, str(pages),
                               str(seconds), *keys], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for i in range(n)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    claims, stop = [], threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):
            claims.append(metric(http, "kvcr_claims_held"))

    sampler = threading.Thread(target=sample, daemon=True)
    t0 = time.monotonic()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    sampler.start()
    results = [json.loads(p.stdout.readline()) for p in procs]
    wall = time.monotonic() - t0
    stop.set()
    for p in procs:
        p.wait(30)
    lat = sorted(x for r in results for x in r["latencies"])
    pulls = len(lat)
    return {"destinations": n, "pulls_per_s": pulls / wall, "gb_per_s": pulls * pages * PAGE / wall / 1e9,
            "p50_ms": statistics.median(lat) * 1e3, "p99_ms": lat[int(0.99 * (pulls - 1))] * 1e3,
            "short": sum(r["short"] for r in results), "wrong": sum(r["wrong_last"] for r in results),
            "claims_max": max(claims, default=0.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--destinations", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--pages", type=int, default=16)
    args = ap.parse_args()
    if unavailable():
        print(f"netns_load: {unavailable()}")
        return 1
    import zmq

    from tests.helpers import RunnerProcess
    public, secret = (k.decode() for k in zmq.curve_keypair())
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    tmp = Path(tempfile.mkdtemp(prefix="kvcr-netns-load-"))
    hosts = make_hosts(3, tmp)
    try:
        a = hosts[0].address
        source = RunnerProcess(tmp, "src", {
            "dram.pools": [{"name": "kv", "page_bytes": PAGE}], "dram.size": "64Mi", "dram.max_claim_fraction": 1.0,
            "runner.control_endpoint": f"tcp://{a}:5600", "events.endpoint": f"tcp://{a}:5557",
            "events.replay_endpoint": f"tcp://{a}:5558", "runner.http_host": a, "runner.http_port": 9400,
            "runner.http_token": TOKEN, "runner.curve_public_key": public, "runner.curve_secret_key": secret,
            "runner.ucx_interface": "eth0", "runner.max_claims_per_peer": 0}, env=env, wrap=hosts[0].wrap())
        info = source.start()
        control, http = info["endpoints"]["control"], info["endpoints"]["http"]
        put = subprocess.run([*hosts[0].wrap(), sys.executable, "-m", "tests.netns_client", "put", control,
                              str(args.pages), "1"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**env, "KVCR_TEST_CURVE_PUBLIC": public, "KVCR_TEST_CURVE_SECRET": secret})
        assert put.returncode == 0, put.stderr
        rss_before = rss_kib(source.proc.pid)
        rows = []
        for n in [1, *args.destinations]:
            print(f"[{len(rows) + 1}/{len(args.destinations) + 1}] {n} destination(s) for {args.seconds:.0f} s",
                  flush=True)
            rows.append(run_load(hosts, env, control, http, n, args.pages, args.seconds, (public, secret)))
            print(f"    {rows[-1]['pulls_per_s']:.0f} pulls/s, p50 {rows[-1]['p50_ms']:.1f} ms, "
                  f"p99 {rows[-1]['p99_ms']:.1f} ms, short {rows[-1]['short']}, wrong {rows[-1]['wrong']}", flush=True)
        rss_after = rss_kib(source.proc.pid)
        final = subprocess.run([*hosts[2].wrap(), sys.executable, "-m", "tests.netns_client", "pull", control,
                                str(args.pages), "1"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                               env={**env, "KVCR_TEST_CURVE_PUBLIC": public, "KVCR_TEST_CURVE_SECRET": secret})
        still = json.loads(final.stdout.splitlines()[-1]) if final.returncode == 0 else {"error": final.stderr[-300:]}
        claims_end = metric(http, "kvcr_claims_held")
        source.stop()
    finally:
        destroy_hosts(3)
    base = rows[0]["pulls_per_s"]
    lines = ["| destinations | pulls/s | × one alone | GB/s | p50 ms | p99 ms | short pulls | wrong bytes | claims held (max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['destinations']} | {r['pulls_per_s']:.0f} | {r['pulls_per_s'] / base:.2f} | "
                     f"{r['gb_per_s']:.2f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['short']} | {r['wrong']} | "
                     f"{r['claims_max']:.0f} |")
    body = (f"## Load: many destinations, one source, across test hosts\n\n"
            f"`bench/netns_load.py --seconds {args.seconds:.0f} --pages {args.pages}` on {machine_line()}: three "
            f"network namespaces on a bridge, UCX over TCP on veth, CURVE on; each destination its own process "
            f"pulling {args.pages} pages of {PAGE >> 10} KiB in a loop. Baseline: one destination alone, same run. "
            f"All processes share the machine's cores, so the totals measure contention, not a network.\n\n"
            + "\n".join(lines) +
            f"\n\nSource resident memory {rss_before / 1024:.0f} MiB before, {rss_after / 1024:.0f} MiB after "
            f"({(rss_after - rss_before) / 1024:+.0f} MiB); claims held after the run: {claims_end:.0f}; a fresh "
            f"pull afterwards: {still}.\n")
    print(body)
    write_section("netns-load", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
