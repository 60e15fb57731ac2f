"""Peer pulls (claim + UCX GETs + release) against a raw one-sided GET loop in the same run.

    .venv/bin/python bench/peer_pull.py [--repeats 5] [--quick]

A source runner (`kvcr serve`, its own process) holds the pages; this process pulls them with
kvcr.drivers.puller.Puller into pre-faulted buffers. Baseline: the same GETs on the same endpoint and
remote key, with no claim and no release (the transport's limit). Shared memory (`UCX_TLS=sm,tcp`)
and TCP (`UCX_TLS=tcp`) are measured in separate child runs, since UCX reads its transport
settings once per process. Small pages are scattered over the destination, so they cannot be
coalesced into larger GETs; large pages land contiguously (one GET per run of pages).
"""

from __future__ import annotations

import argparse
import ctypes
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

TRANSPORTS = {"shared memory": "sm,tcp", "tcp": "tcp"}
STREAMS = (1, 2, 4)  # the plain-socket ceiling: the best of these many TCP connections at once
CASES = [(4 << 10, 512), (64 << 10, 256), (1 << 20, 64), (8 << 20, 16)]


def start_source(tmp: Path, page_bytes: int, pages: int, env: dict) -> tuple[subprocess.Popen, dict]:
    info_file = tmp / f"src-{page_bytes}.json"
    size = page_bytes * pages * 2 + (16 << 20)
    proc = subprocess.Popen([sys.executable, "-m", "kvcr.cli", "serve", "--info-file", str(info_file),
                             "--set", f"runner.name=bench-src-{page_bytes}", "--set", f"dram.size={size}",
                             "--set", f'dram.pools=[{{"name":"kv","page_bytes":{page_bytes}}}]',
                             "--set", "dram.max_claim_fraction=1.0",
                             # The TCP rows stand for a peer on another host: claims over ZMQ, without
                             # the cost of CURVE (a keyless runner serves them only over its Unix socket).
                             "--set", "runner.insecure=true",
                             # digests taken as pages are committed (outside the timed pulls), so a
                             # checked pull costs what it costs a secured deployment
                             "--set", "runner.verify_transfer_bytes=true"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp / f"src-{page_bytes}.log", "w"))
    deadline = time.monotonic() + 30
    while not info_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((tmp / f"src-{page_bytes}.log").read_text())
        time.sleep(0.05)
    return proc, json.loads(info_file.read_text())


def start_filled_source(tmp: Path, page_bytes: int, pages: int, env: dict, payload: list[bytes] | None = None
                        ) -> tuple[subprocess.Popen, str, list[str], list[bytes]]:
    """A source runner holding `pages` pages under a request's page keys (page i is byte i % 251
    unless `payload` is given); returns (process, control endpoint, keys, payload)."""
    from kvcr.client import AttachedWriter, ControlClient
    from kvcr.proto.keys import request_page_hashes

    proc, info = start_source(tmp, page_bytes, pages, env)
    control = info["endpoints"]["control"]
    keys = request_page_hashes(list(range(pages * 16)), 16)
    payload = payload or [bytes([i % 251]) * page_bytes for i in range(pages)]
    with ControlClient(control) as client:
        deadline = time.monotonic() + 10
        while not client.info()["ucx"]["rkeys"] and time.monotonic() < deadline:
            time.sleep(0.05)
        writer = AttachedWriter(client)
        writer.put("kv", keys, payload)
        writer.close()
    return proc, control, keys, payload


def socket_server(total: int, streams: int) -> None:
    """Serve `total` bytes over `streams` loopback connections, each its share per request byte."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    share = memoryview(os.urandom(total // streams))

    def serve(conn: socket.socket) -> None:
        with conn:
            while conn.recv(1):
                conn.sendall(share)
    conns = [listener.accept()[0] for _ in range(streams)]
    threads = [threading.Thread(target=serve, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def socket_times(total: int, repeats: int) -> dict[int, list[float]]:
    """The same bytes over plain TCP sockets between two processes (loopback), per stream count:
    the transfer a TCP-only peer could reach without UCX."""
    import socket
    import threading

    out = {}
    for streams in STREAMS:
        server = subprocess.Popen([sys.executable, __file__, "--socket-server", f"{total},{streams}"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
            dest = memoryview(bytearray(total))
            share = total // streams

            def fetch(conn: socket.socket, view: memoryview) -> None:
                conn.sendall(b"x")
                got = 0
                while got < len(view):
                    got += conn.recv_into(view[got:])

            def once() -> float:
                t0 = time.perf_counter()
                threads = [threading.Thread(target=fetch, args=(c, dest[i * share:(i + 1) * share]))
                           for i, c in enumerate(conns)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                return time.perf_counter() - t0
            once()
            out[streams] = [once() for _ in range(repeats)]
            for c in conns:
                c.close()
        finally:
            server.wait(10)
    return out


def child(transport: str, repeats: int, quick: bool) -> list[dict]:
    from kvcr.drivers.ucx_plane import UcxPlane
    from kvcr.drivers.puller import Puller
    from kvcr.proto.pull import plan_gets

    plane = UcxPlane(progress_thread=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcr-bench-pull-") as tmp:
        for page_bytes, pages in (CASES[:2] if quick else CASES):
            proc, control, keys, payload = start_filled_source(Path(tmp), page_bytes, pages, dict(os.environ),
                                                               [os.urandom(page_bytes) for _ in range(pages)])
            try:
                # TCP stands for another host: its claims go over ZMQ, not the same-host socket
                # the source is named: a keyless source over TCP is pulled from only when trusted by name
                trusted = frozenset({control})
                puller = Puller(plane, timeout_s=30, abandon_s=5, local_control=transport != "tcp", trusted=trusted)
                checking = Puller(plane, timeout_s=30, abandon_s=5, local_control=transport != "tcp", trusted=trusted,
                                  verify_transfer_bytes=True)  # the source's commit-time digests, checked
                dest = ctypes.create_string_buffer(page_bytes * pages)
                slots = list(range(pages))
                if page_bytes < (64 << 10):
                    random.Random(0).shuffle(slots)  # scattered: no two pages adjacent on both sides
                dests = [ctypes.addressof(dest) + s * page_bytes for s in slots]
                ctypes.memset(dest, 1, page_bytes * pages)  # pre-fault
                src = puller.source(control)
                conf = puller.confirm(control, "kv", keys)
                ops = plan_gets(dests, conf.offsets, page_bytes, chunks=src.terms.chunks)
                puller.release(conf)
                raw_ops = [(op.local, op.nbytes, op.remote_offset) for op in ops]

                def raw() -> float:
                    t0 = time.perf_counter()
                    r = plane.get(src.address, src.rkeys, src.region_base, raw_ops, timeout_s=30, abandon_s=5)
                    assert all(r.done), r.error
                    return time.perf_counter() - t0

                def ours() -> float:
                    t0 = time.perf_counter()
                    assert puller.pull(control, "kv", keys, dests).delivered == pages
                    return time.perf_counter() - t0

                def tagged() -> float:
                    puller.transport = "tag"
                    try:
                        return ours()
                    finally:
                        puller.transport = "get"

                def checked() -> float:
                    t0 = time.perf_counter()
                    assert checking.pull(control, "kv", keys, dests).delivered == pages
                    return time.perf_counter() - t0

                def copied() -> float:  # the same-host copy `auto` picks on one host
                    puller.transport = "shm"
                    try:
                        return ours()
                    finally:
                        puller.transport = "get"

                same_host = transport == "shared memory"
                raw(), ours(), tagged(), checked(), same_host and copied()  # warm-up: endpoints, rkeys, faults
                base, cand, tag, check, copy = [], [], [], [], []
                for _ in range(repeats):
                    base.append(raw())
                    cand.append(ours())
                    tag.append(tagged())
                    check.append(checked())
                    if same_host:
                        copy.append(copied())
                got = ctypes.string_at(dest, page_bytes * pages)
                assert all(got[s * page_bytes:(s + 1) * page_bytes] == payload[i] for i, s in enumerate(slots))
                rtt = []
                if page_bytes == (64 << 10):  # claim round trip of 128 pages (confirm + release)
                    for _ in range(200):
                        t0 = time.perf_counter()
                        conf = puller.confirm(control, "kv", keys[:128])
                        puller.release(conf)
                        rtt.append(time.perf_counter() - t0)
                total = page_bytes * pages
                sockets = socket_times(total, repeats) if transport == "tcp" else {}
                rows.append({"transport": transport, "page_bytes": page_bytes, "pages": pages, "gets": len(ops),
                             "base": [total / t / 1e9 for t in base], "cand": [total / t / 1e9 for t in cand],
                             "copy": [total / t / 1e9 for t in copy],
                             "sockets": {str(n): [total / t / 1e9 for t in ts] for n, ts in sockets.items()},  # JSON keys
                             "tag": [total / t / 1e9 for t in tag], "checked": [total / t / 1e9 for t in check],
                             "overhead_us": [(c - b) / pages * 1e6 for c, b in zip(cand, base)],
                             "rtt_ms": sorted(x * 1e3 for x in rtt)})
                puller.close()
                checking.close()
            finally:
                proc.terminate()
                proc.wait(15)
    plane.close()
    return rows


def fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return (f"{statistics.median(values) * scale:.{digits}f} "
            f"({min(values) * scale:.{digits}f}–{max(values) * scale:.{digits}f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--socket-server", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.socket_server:
        socket_server(*map(int, args.socket_server.split(",")))
        return 0
    repeats = max(5, args.repeats)
    if args.child:
        print(json.dumps(child(args.child, repeats, args.quick)))
        return 0
    from bench.common import child_rows, machine_line, publish, table

    rows, lines, chart = [], [], {}
    for name, tls in TRANSPORTS.items():
        env = {**os.environ, "UCX_TLS": tls, "UCX_NET_DEVICES": "lo", "UCX_TCP_TX_SEG_SIZE": "256k",
               "UCX_TCP_RX_SEG_SIZE": "256k", "UCX_WARN_UNUSED_ENV_VARS": "n"}
        print(f"  {name}: UCX_TLS={tls}", flush=True)
        cmd = [sys.executable, __file__, "--child", name, "--repeats", str(repeats),
               *(["--quick"] if args.quick else [])]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise SystemExit(out.stderr)
        rows += child_rows(out.stdout)
    for r in rows:
        ratio = [c / b for c, b in zip(r["cand"], r["base"])]
        lines.append(f"| {r['transport']} | {r['page_bytes'] >> 10} KiB | {r['pages']} | {r['gets']} | "
                     f"{fmt(r['base'])} | {fmt(r['cand'])} | {fmt(ratio, 100, 0)} % | {fmt(r['overhead_us'], 1, 1)} | "
                     f"{fmt(r['tag'])} | {fmt(r['checked'])} | "
                     f"{fmt([c / d - 1 for c, d in zip(r['cand'], r['checked'])], 100, 0)} % |")
        print(lines[-1])
        chart[f"{r['transport']}, {r['page_bytes'] >> 10} KiB"] = {
            "raw GET loop": r["base"], "kvcr pull": r["cand"], "kvcr tagged fallback": r["tag"]}
    # On one host: is UCX's shared-memory GET ever worth picking over the copy `auto` makes?
    same_host_lines = [f"| {r['page_bytes'] >> 10} KiB | {r['pages']} | {fmt(r['copy'])} | {fmt(r['cand'])} | "
                       f"{fmt([c / g for c, g in zip(r['copy'], r['cand'])])}× |"
                       for r in rows if r["copy"]]
    # TCP: kvcr's pull against UCX's raw GET and against plain sockets moving the same bytes
    tcp_lines = []
    for r in (r for r in rows if r["sockets"]):
        best = max(r["sockets"], key=lambda n: statistics.median(r["sockets"][n]))
        tcp_lines.append(f"| {r['page_bytes'] >> 10} KiB | {r['pages']} | {fmt(r['cand'])} | {fmt(r['base'])} | "
                         + " | ".join(fmt(r["sockets"][str(n)]) for n in STREAMS)
                         + f" | {fmt([c / b for c, b in zip(r['cand'], r['base'])], 100, 0)} % | "
                         f"{fmt([c / s for c, s in zip(r['cand'], r['sockets'][best])], 100, 0)} % ({best}) |")
    for line in same_host_lines + tcp_lines:
        print(line)
    rtt = [r for r in rows if r["rtt_ms"]]
    rtt_lines = [f"| {r['transport']} | {statistics.median(r['rtt_ms']):.3f} | "
                 f"{r['rtt_ms'][int(len(r['rtt_ms']) * 0.99) - 1]:.3f} |" for r in rtt]
    for line in rtt_lines:
        print("claim RTT", line)
    intro = (f"`python bench/peer_pull.py --repeats {repeats}` on {machine_line()}: a source runner process and "
             f"this process, loopback. Median (min–max) of {repeats} alternating repeats, GB/s. Baseline: the same "
             "one-sided GETs on the same endpoint and rkey, no claim or release (blocking-mode progress at the "
             "source, our own polling at the destination, all GETs of a batch in flight, "
             "`UCX_TCP_*_SEG_SIZE=256k`). kvcr: `Puller.pull` = claim round trip over ZMQ, the GETs, release. "
             "Pages under 64 KiB are scattered over the destination (one GET per page); larger ones are "
             "coalesced into one GET per contiguous run (`GETs` column). Overhead = (kvcr − baseline) time per "
             "page. The last column is the two-sided fallback (`runner.transfer = \"tag\"`: receives posted, "
             "the source sends). Digests checked: the same pull asking the source for its pages' commit-time "
             "digests and checking the received bytes against them (what CURVE keys turn on); cost = "
             "kvcr / checked − 1.\n\nClaim round trip (confirm of 128 pages + release, 200 samples), ms: see "
             "the second table. The third: on one host, the same-host copy (`runner.transfer = \"shm\"`, what "
             "`auto` picks there: the source's pool mapped read-only) against the UCX GET pull over shared "
             "memory, in the same repeats. The fourth: the TCP pull against UCX's raw GET and against plain "
             "TCP sockets moving the same bytes between two processes (1, 2, 4 connections at once, "
             "`recv_into` a pre-faulted buffer, contiguous where kvcr's 4 KiB pages are scattered, one thread "
             "per connection); the last column is kvcr against "
             "the best of those (its stream count in brackets).")
    columns = ["transport", "page", "pages", "GETs", "baseline GB/s", "kvcr GB/s", "kvcr/baseline",
               "overhead µs/page", "kvcr tagged fallback GB/s", "kvcr, digests checked GB/s", "digest cost"]
    same_host_columns = ["page", "pages", "same-host copy GB/s", "UCX GET pull GB/s", "copy / GET"]
    tcp_columns = ["page", "pages", "kvcr pull GB/s", "UCX raw GET GB/s",
                   *(f"plain TCP, {n} conn. GB/s" for n in STREAMS), "kvcr / UCX raw GET", "kvcr / best plain TCP"]
    publish("peer_pull", "Peer pulls over UCX", intro,
            [table(columns, lines), table(["transport", "claim RTT p50 ms", "p99 ms"], rtt_lines),
             table(same_host_columns, same_host_lines), table(tcp_columns, tcp_lines)],
            write=not (args.no_write or args.quick), chart=chart)  # a partial run never replaces the full table
    return 0


if __name__ == "__main__":
    sys.exit(main())
