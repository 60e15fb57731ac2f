"""Where a peer pull's time goes, phase by phase, against the raw floors measured in the same run.

    .venv/bin/python bench/pull_breakdown.py [--repeats 5] [--py-spy]

A source runner process and this process, loopback, at the anchors' sizes (16 x 64 KiB and
32 x 1 MiB, destinations as bench/kvcr_side.py lays them out), for shared memory with UCX GETs
and for TCP. Per iteration, in turn, each after a 2 ms pause (so the phase before it, whose release
is queued, has ended):
- echo: one ZMQ round trip of a claim-sized frame to a Python echo socket in another process (the
  floor of any control round trip between two Python processes);
- lookup: kvcr's control round trip with its codec and the runner's handler, no claim;
- confirm: the claim round trip (`Puller.confirm`);
- confirm, digests: the same claim asking a digest of every page, as a secured deployment's pulls
  do (keys turn page digests on); the source computes them off its control thread;
- deliver: the GETs and the release, which is queued, not waited for (`Puller.deliver`);
- raw GET: the same GETs on the same endpoint and rkey, no claim (the transport's floor);
- pull: `Puller.pull`, all of it.
Then, back to back at 16 x 64 KiB, what one round trip costs: wall time, and the CPU time the
source process (ZMQ's I/O thread included) and this one spend per lookup and per claim plus
release, against a ZMQ echo, a plain TCP socket echo and a Unix socket echo between the same two
kinds of process. Over shared memory the claims take the source's same-host Unix socket; the TCP
rows stand for another host and keep ZMQ.
With `--py-spy`, the pulling process is sampled during a loop of pulls and its busy samples are
split by what they were doing.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRANSPORTS = {"shared memory (UCX GET)": "sm,tcp", "TCP": "tcp"}
CASES = [(64 << 10, 16), (1 << 20, 32)]
SETTLE_S = 0.002  # between phases: the one before (a queued release, UCX's tail) is over
PHASES = ("echo", "lookup", "confirm", "confirm_digests", "deliver", "raw_get", "pull")
PHASE_NAMES = ("ZMQ echo", "lookup", "confirm (claim)", "confirm, digests", "deliver", "raw GET", "pull")
ECHO = """
import sys, zmq
sock = zmq.Context().socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    sock.send_multipart(sock.recv_multipart())
"""
TCP_ECHO = """
import socket
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(1 << 16):
    conn.sendall(data)
"""
UNIX_ECHO = """
import os, socket
name = "kvcr-bench-echo-%d" % os.getpid()
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\\0" + name)  # abstract: no file to clean up
srv.listen(1)
print(name, flush=True)
conn, _ = srv.accept()
while data := conn.recv(1 << 16):
    conn.sendall(data)
"""
# py-spy leaf frames, in order of precedence, and what they mean for a pull.
AREAS = (("waiting on the control reply", ("poll.py", "socket.py", "local_control.py")),
         ("UCX transfer and its polling", ("ucx_rma.py", "ucx_plane.py", "ucxx")),
         ("message codec", ("messages.py", "msgpack")),
         ("pull state machine and planning", ("proto/pull.py",)),
         ("puller driver", ("puller.py", "peer_source.py", "client.py")))


def start_echo(script: str = ECHO) -> tuple[subprocess.Popen, str]:
    """The echo process and where it listens: a port, or a Unix socket's path."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def round_trip_costs(ops: dict, source_pid: int, n: int) -> dict[str, dict[str, float]]:
    """Per op, back to back: wall time, the source's CPU time (0 for the echoes, which are not
    the source) and this process's CPU time, all in seconds."""
    costs = {}
    for name, op in ops.items():
        op()
        wall, src, own = time.perf_counter(), _cpu_s(source_pid), time.process_time()
        for _ in range(n):
            op()
        costs[name] = {"wall": (time.perf_counter() - wall) / n, "source": (_cpu_s(source_pid) - src) / n,
                       "client": (time.process_time() - own) / n}
    return costs


def child(transport: str, repeats: int, iterations: int, spy: str) -> list[dict]:
    import zmq

    from bench.peer_pull import start_filled_source
    from kvcr.drivers.puller import Puller
    from kvcr.drivers.ucx_plane import UcxPlane
    from kvcr.proto import messages as m
    from kvcr.proto.pull import plan_gets

    plane = UcxPlane(progress_thread=False)
    echo_proc, echo_port = start_echo()
    echo = zmq.Context.instance().socket(zmq.DEALER)
    echo.connect(f"tcp://127.0.0.1:{echo_port}")
    tcp_proc, tcp_port = start_echo(TCP_ECHO)
    tcp_echo = socket.create_connection(("127.0.0.1", int(tcp_port)))
    tcp_echo.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    unix_proc, unix_path = start_echo(UNIX_ECHO)
    unix_echo = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_echo.connect("\0" + unix_path)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvcr-bench-breakdown-") as tmp:
            for page_bytes, pages in CASES:
                proc, control, keys, payload = start_filled_source(Path(tmp), page_bytes, pages, dict(os.environ))
                try:
                    local = transport != "TCP"  # TCP stands for another host: claims over ZMQ
                    trusted = frozenset({control})  # a keyless source over TCP: trusted by name
                    puller = Puller(plane, timeout_s=30, abandon_s=5, transport="get", local_control=local,
                                    trusted=trusted)
                    checking = Puller(plane, timeout_s=30, abandon_s=5, transport="get", verify_transfer_bytes=True,
                                      local_control=local, trusted=trusted)
                    sleeping = Puller(plane, timeout_s=30, abandon_s=5, transport="get", local_control=local, trusted=trusted,
                                      reply_spin_s=0)  # waits for replies asleep at once
                    dest = ctypes.create_string_buffer(pages * page_bytes)
                    dests = [ctypes.addressof(dest) + i * page_bytes for i in range(pages)]
                    src = puller.source(control)
                    conf = puller.confirm(control, "kv", keys)
                    ops = [(op.local, op.nbytes, op.remote_offset)
                           for op in plan_gets(dests, conf.offsets, page_bytes, chunks=src.terms.chunks)]
                    puller.release(conf)
                    frame = m.encode(m.ClaimRequest(pool="kv", keys=list(keys), lease_s=5.0, request_id=1))
                    steps = _steps(puller, checking, plane, src, echo, frame, control, keys, dests, ops)
                    for step in steps.values():
                        step()  # warm-up: endpoints, rkeys, page faults
                    runs = {name: [] for name in steps}
                    for _ in range(repeats):
                        samples = {name: [] for name in steps}
                        for _ in range(iterations):
                            for name, step in steps.items():
                                time.sleep(SETTLE_S)
                                samples[name].append(step())
                        for name, values in samples.items():
                            runs[name].append(statistics.median(values))
                    assert ctypes.string_at(dest, pages * page_bytes) == b"".join(payload), "wrong bytes"
                    shares = _sampled(spy, lambda: steps["pull"]()) if spy else {}
                    costs = round_trip_costs(_round_trips(puller, sleeping, echo, tcp_echo, unix_echo, frame, control, keys),
                                             proc.pid,
                                             20 * iterations) if page_bytes == CASES[0][0] else {}
                    rows.append({"transport": transport, "page_bytes": page_bytes, "pages": pages, "gets": len(ops),
                                 "runs": runs, "shares": shares, "costs": costs})
                    puller.close()
                    checking.close()
                    sleeping.close()
                finally:
                    proc.terminate()
                    proc.wait(15)
    finally:
        echo_proc.kill()
        tcp_proc.kill()
        unix_proc.kill()
        plane.close()
    return rows


def _round_trips(puller, sleeping, echo, tcp_echo, unix_echo, frame: bytes, control: str, keys) -> dict:
    def zmq_echo() -> None:
        echo.send_multipart([b"", frame])
        echo.recv_multipart()

    def socket_echo(sock) -> None:
        sock.sendall(frame)
        got = 0
        while got < len(frame):
            got += len(sock.recv(1 << 16))

    def claim_and_release(who) -> None:
        who.release(who.confirm(control, "kv", keys))

    return {"plain TCP socket echo": lambda: socket_echo(tcp_echo), "Unix socket echo": lambda: socket_echo(unix_echo),
            "ZMQ echo": zmq_echo,
            "lookup": lambda: puller.lookup(control, "kv", keys), "claim + release": lambda: claim_and_release(puller),
            "claim + release, asleep at once": lambda: claim_and_release(sleeping)}


def _steps(puller, checking, plane, src, echo, frame: bytes, control: str, keys, dests, ops) -> dict:
    def timed(fn):
        def step() -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return step

    def echo_once() -> None:
        echo.send_multipart([b"", frame])
        echo.recv_multipart()

    def raw_get() -> None:
        result = plane.get(src.address, src.rkeys, src.region_base, ops, timeout_s=30, abandon_s=5)
        assert all(result.done), result.error

    held = []

    def confirm() -> None:
        held.append(puller.confirm(control, "kv", keys))
        assert held[-1] is not None and held[-1].num_pages == len(keys)

    def confirm_digests() -> None:
        conf = checking.confirm(control, "kv", keys)
        assert conf is not None and len(conf.digests) == len(keys)
        checking.release(conf, wait=False)  # queued, as `deliver` does

    def deliver() -> None:
        assert puller.deliver(held.pop(), dests).delivered == len(keys)

    def pull() -> None:
        assert puller.pull(control, "kv", keys, dests).delivered == len(keys)

    return {"echo": timed(echo_once), "lookup": timed(lambda: puller.lookup(control, "kv", keys)),
            "confirm": timed(confirm), "confirm_digests": timed(confirm_digests), "deliver": timed(deliver), "raw_get": timed(raw_get), "pull": timed(pull)}


def _sampled(spy: str, pull, seconds: float = 3.0) -> dict[str, float]:
    """py-spy over this process while it pulls: the pulling thread's samples by area."""
    raw = Path(tempfile.mkdtemp(prefix="kvcr-spy-")) / "raw.txt"
    rec = subprocess.Popen([spy, "record", "-p", str(os.getpid()), "-r", "1000", "--threads", "--nonblocking",
                            "-f", "raw", "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pull()
    rec.send_signal(signal.SIGINT)
    rec.wait(60)
    counts = {name: 0 for name, _ in AREAS} | {"other": 0}
    for line in raw.read_text().splitlines() if raw.exists() else []:
        stack, n = line.rsplit(" ", 1)
        if "pull_breakdown.py" not in stack:
            continue  # another thread: the release sender, idle on its queue
        leaf = stack.split(";")[-1]
        area = next((name for name, marks in AREAS if any(mark in leaf for mark in marks)), "other")
        counts[area] += int(n)
    total = sum(counts.values()) or 1
    shutil.rmtree(raw.parent, ignore_errors=True)
    return {name: n / total for name, n in counts.items()} | {"samples": total}


def fmt_ms(values: list[float]) -> str:
    return (f"{statistics.median(values) * 1e3:.3f} ({min(values) * 1e3:.3f}–{max(values) * 1e3:.3f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=100, help="samples per phase in each repeat")
    parser.add_argument("--py-spy", action="store_true", help="also sample the pulling process with py-spy")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--spy-path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.repeats, args.iterations, args.spy_path)))
        return 0
    from bench.common import child_rows, machine_line, publish, table

    spy = ""
    if args.py_spy:
        spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy") or ""
        if not spy:
            print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
            return 2
    rows = []
    for name, tls in TRANSPORTS.items():
        env = {**os.environ, "UCX_TLS": tls, "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
        print(f"  {name}: UCX_TLS={tls}", flush=True)
        cmd = [sys.executable, __file__, "--child", name, "--repeats", str(args.repeats),
               "--iterations", str(args.iterations), "--spy-path", spy]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise SystemExit(out.stderr)
        rows += child_rows(out.stdout)
    lines, spy_lines, cost_lines, chart = [], [], [], {}
    for r in rows:
        for name, c in r["costs"].items():
            cost_lines.append(f"| {r['transport']} | {name} | {c['wall'] * 1e6:.0f} | "
                              + (f"{c['source'] * 1e6:.0f}" if name.startswith(("lookup", "claim")) else "–")
                              + f" | {c['client'] * 1e6:.0f} |")
            print("cost:", cost_lines[-1])
        runs = r["runs"]
        chart[f"{r['transport'].split(' (')[0]}, {r['pages']} × {r['page_bytes'] >> 10} KiB"] = {
            name: [t * 1e3 for t in runs[key]] for key, name in zip(PHASES, PHASE_NAMES)}
        over = [p - g for p, g in zip(runs["pull"], runs["raw_get"])]
        lines.append(f"| {r['transport']} | {r['pages']} × {r['page_bytes'] >> 10} KiB | "
                     + " | ".join(fmt_ms(runs[p]) for p in PHASES) + f" | {fmt_ms(over)} |")
        print(lines[-1])
        if r["shares"]:
            shares = r["shares"]
            spy_lines.append(f"| {r['transport']} | {r['pages']} × {r['page_bytes'] >> 10} KiB | {shares['samples']} | "
                             + " | ".join(f"{shares[a]:.0%}" for a, _ in AREAS) + f" | {shares['other']:.0%} |")
            print(spy_lines[-1])
    intro = (f"`python bench/pull_breakdown.py --repeats {args.repeats}{' --py-spy' if spy else ''}` on "
             f"{machine_line()}: a source runner process and this process, loopback. Each phase is timed "
             f"{args.iterations} times per repeat, in turn with the others, each after a {SETTLE_S * 1e3:.0f} ms "
             "pause so that the release the phase before queued has ended (the pauses cost wake-ups: back to "
             "back, as in the anchor comparisons, a pull is faster); median (min–max) over the "
             f"{args.repeats} repeats' medians, ms. On shared memory the puller asks over the source's "
             "same-host Unix socket (`runner.local_control`); the TCP rows stand for another host, so they ask "
             "over ZMQ. echo: a ZMQ round trip of a claim-sized frame to a Python "
             "echo socket in another process (the floor of a control round trip between two Python processes). "
             "lookup: kvcr's control round trip (codec and the runner's handler, no claim). confirm: the claim. "
             "confirm, digests: the claim with a digest of every page, as a secured deployment's pulls ask it "
             "(computed off the source's control thread). "
             "deliver: the GETs, then the release (queued, not waited for). raw GET: the same GETs with no claim "
             "(the transport's floor). pull: `Puller.pull`, all of it; a pull is confirm + deliver. The last "
             "column is what a pull costs over the raw GETs. The second table: back to back at 16 × 64 KiB, "
             f"{20 * args.iterations} of each, per op, the wall time and the CPU time the source process (ZMQ's I/O "
             "thread included) and this process spend; the echoes answer from Python processes of their own "
             "(a ZMQ ROUTER, a plain TCP socket with TCP_NODELAY, and a Unix stream socket). Pullers first wait "
             "for a reply without sleeping (`runner.reply_spin_us`, 500 µs); \"asleep at once\" is a puller that "
             "does not (`reply_spin_us = 0`), in the same run. The spin is busy time, so the third table (py-spy) counts "
             "most of a claim's wait under \"waiting on the control reply\".")
    tables = [table(["transport", "pages", "echo", "lookup", "confirm", "confirm, digests", "deliver", "raw GET", "pull",
                     "pull − raw GET"], lines)]
    tables.append(table(["transport", "back to back, 16 × 64 KiB", "wall µs", "source CPU µs", "client CPU µs"],
                        cost_lines))
    if spy_lines:
        tables.append(table(["transport", "pages", "busy samples", *(a for a, _ in AREAS), "other"], spy_lines))
    publish("pull_breakdown", "Where a pull's time goes", intro, tables, write=not args.no_write, chart=chart,
            unit="ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
