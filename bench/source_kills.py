"""Source crashes during pulls: one pulling process, a source runner SIGKILLed 0-20 ms into
about a third of its pulls and restarted on the same control port (its pages re-put at other
offsets), then the same process pulls on, with the shipped back-off and probes.

    .venv/bin/python bench/source_kills.py [--transport get|tag|shm] [--runs 100]

Every pull lands in a buffer poisoned first; each delivered page is compared with the bytes put.
Prints per run what arrived, then the totals: kills, pulls that delivered everything, wrong
bytes (must be 0), uncertain results (must be 0), the longest pull after a kill, and the pulls
that started 1 s or more after the restarted source first answered an info request yet missed
(must be 0: docs/reliability.md).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvcr.client import AttachedWriter, ControlClient  # noqa: E402
from kvcr.proto.announce import announce_request  # noqa: E402
from kvcr.proto.keys import request_page_hashes  # noqa: E402
from tests.helpers import RunnerProcess, wait_until  # noqa: E402

PAGE, PAGES, BLOCK = 64 << 10, 256, 16


def pages(seed: int, n: int) -> tuple[list[str], list, list[bytes]]:
    rng = random.Random(seed)
    tokens = [rng.randrange(50000) for _ in range(n * BLOCK)]
    return request_page_hashes(tokens, BLOCK), announce_request(tokens, BLOCK), [rng.randbytes(PAGE) for _ in range(n)]


RECOVERY_S = 1.0


def first_answer(endpoint: str) -> float:
    """When `endpoint` first answers an info request, asked every ~20 ms over TCP."""
    from kvcr.proto import messages as m

    with ControlClient(endpoint, timeout_s=0.02, local=False) as client:
        while True:
            try:
                client.request(m.InfoRequest())
                return time.monotonic()
            except TimeoutError:
                continue


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Source:
    def __init__(self, tmp: Path) -> None:
        self.control = f"tcp://127.0.0.1:{free_port()}"
        self.proc = RunnerProcess(tmp, "src", {"dram.pools": [{"name": "kv", "page_bytes": PAGE}], "dram.size": "64Mi",
                                               "runner.control_endpoint": self.control})
        self.keys, self.announces, self.data = pages(1, PAGES)

    def start(self) -> float:
        """Starts it and fills it; returns when it first answered."""
        answered: list[float] = []
        watcher = threading.Thread(target=lambda: answered.append(first_answer(self.control)), daemon=True)
        watcher.start()
        self.proc.start()
        watcher.join(30)
        with ControlClient(self.control) as client:
            wait_until(lambda: client.info()["ucx"]["rkeys"], 10, 0.05, "UCX registration")
            writer = AttachedWriter(client)
            filler = pages(random.randrange(1 << 30), random.randrange(1, 50))  # other offsets each time
            writer.put("kv", filler[0], filler[2], filler[1])
            writer.put("kv", self.keys, self.data, self.announces)
            writer.close()
        return answered[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", choices=["get", "tag", "shm"], default="get")
    ap.add_argument("--runs", type=int, default=100)
    args = ap.parse_args()
    from kvcr.drivers.ucx_plane import UcxPlane
    from kvcr.drivers.puller import Puller

    source = Source(Path(tempfile.mkdtemp(prefix="kvcr-kills-")))
    source.start()
    plane = UcxPlane()
    # The shipped back-off (5 s, doubling) and probes: a restarted source must be pulled from again
    # within RECOVERY_S of answering.
    puller = Puller(plane, timeout_s=3, abandon_s=3, transport=args.transport)
    buf = ctypes.create_string_buffer(PAGE * PAGES)
    dests = [ctypes.addressof(buf) + i * PAGE for i in range(PAGES)]
    kills = whole = wrong = uncertain = late_misses = early_misses = 0
    after_kill = 0.0
    back_at = float("-inf")  # when the restarted source first answered
    killed_last = False
    for run in range(args.runs):
        ctypes.memset(buf, 0xAB, PAGE * PAGES)
        kill = random.random() < 0.3
        if kill:
            threading.Timer(random.uniform(0, 0.02), source.proc.proc.kill).start()
        t0 = time.monotonic()
        result = puller.pull(source.control, "kv", source.keys, dests)
        took = time.monotonic() - t0
        if not kill and result.delivered < PAGES:  # a miss with the source up and not killed this pull
            if t0 >= back_at + RECOVERY_S:
                late_misses += 1
            else:
                early_misses += 1
        bad = sum(buf.raw[i * PAGE:(i + 1) * PAGE] != source.data[i] for i in range(result.delivered))
        wrong, uncertain, whole = wrong + bad, uncertain + result.uncertain, whole + (result.delivered == PAGES)
        if killed_last:
            after_kill = max(after_kill, took)
        print(f"[{run + 1}/{args.runs}] kill={kill} delivered={result.delivered} wrong={bad} "
              f"uncertain={result.uncertain} {took:.2f} s {result.error[:70]}", flush=True)
        killed_last = kill
        if kill:
            kills += 1
            source.proc.proc.wait()
            back_at = source.start()
    print(f"transport {args.transport}: {args.runs} pulls, {kills} kills, {whole} delivered all {PAGES} pages, "
          f"{wrong} wrong pages, {uncertain} uncertain, longest pull after a kill {after_kill:.2f} s, "
          f"{plane.num_retired_workers} workers retired; misses within {RECOVERY_S:.0f} s of a restart "
          f"{early_misses}, later {late_misses} (back-offs a probe ended: {puller.reach.num_recovered})")
    source.proc.stop()
    puller.close()
    plane.close()
    return 1 if wrong or uncertain or late_misses else 0


if __name__ == "__main__":
    sys.exit(main())
