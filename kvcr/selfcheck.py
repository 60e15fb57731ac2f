"""Self-check: store pages in a running runner, read them back byte for byte, watch the events.

`kvcr demo` runs it against a runner it starts itself, with `kvcr events tail` alongside.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .client import AttachedWriter, ControlClient
from .proto.announce import announce_request
from .proto.keys import request_page_hashes

SAMPLE_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "runner.toml"


def run_selfcheck(control: str, *, pages: int = 64, seed: int = 0, out=sys.stderr) -> int:
    with ControlClient(control) as client:
        writer = AttachedWriter(client)
        try:
            pool = writer.info["pools"][0]
            block = writer.info["block_size"]
            rng = random.Random(seed)
            tokens = [rng.randrange(32000) for _ in range(pages * block)]
            keys = request_page_hashes(tokens, block)
            announces = announce_request(tokens, block, event_format=writer.info["event_format"])
            data = [rng.randbytes(pool["page_bytes"]) for _ in range(pages)]
            t0 = time.perf_counter()
            stored = writer.put(pool["name"], keys, data, announces)
            back = writer.get(pool["name"], keys)
            took = time.perf_counter() - t0
        finally:
            writer.close()
    same = sum(1 for a, b in zip(data, back) if a == b)
    print(f"selfcheck: stored {stored}/{pages} pages of {pool['page_bytes']} bytes, read back {len(back)}, "
          f"{same} identical ({took * 1000:.1f} ms)", file=out)
    return 0 if stored == pages and same == pages else 1


def _wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"kvcr serve exited with code {proc.returncode} before it came up")
        time.sleep(0.05)
    raise TimeoutError(f"kvcr serve did not come up within {timeout_s} s")


def run_demo(*, config: str | None = None, pages: int = 64) -> int:
    config = config or str(SAMPLE_CONFIG)
    with tempfile.TemporaryDirectory(prefix="kvcr-demo-") as tmp:
        info_file = Path(tmp) / "info.json"
        log = open(Path(tmp) / "serve.log", "w")
        cli = [sys.executable, "-m", "kvcr.cli"]
        print(f"[1/4] starting kvcr serve --config {config}", file=sys.stderr)
        serve = subprocess.Popen([*cli, "serve", "--config", config, "--info-file", str(info_file),
                                  "--set", f"runner.state_dir={tmp}"], stdout=log, stderr=log)
        try:
            info = _wait_for_file(info_file, serve, 30)
            ep = info["endpoints"]
            print(f"      events {ep['events']}  replay {ep['replay']}  control {ep['control']}  "
                  f"metrics {ep['http']}/metrics", file=sys.stderr)
            print(f"[2/4] kvcr events tail --endpoint {ep['events']} --replay {ep['replay']}", file=sys.stderr)
            tail_out = open(Path(tmp) / "tail.jsonl", "w+")
            tail = subprocess.Popen([*cli, "events", "tail", "--endpoint", ep["events"], "--replay", ep["replay"],
                                     "--count", str(pages), "--timeout", "30"], stdout=tail_out)
            time.sleep(1.0)  # slow joiner: a SUB misses what was sent before it connected
            print(f"[3/4] self-check: {pages} pages through the shared-memory pool", file=sys.stderr)
            rc = run_selfcheck(ep["control"], pages=pages)
            tail_rc = tail.wait(40)
            tail_out.seek(0)
            lines = [json.loads(line) for line in tail_out if line.strip()]
            stored = sum(len(x["event"]["block_hashes"]) for x in lines if x["event"]["type"] == "BlockStored")
            print(f"[4/4] events tail saw {stored} stored blocks in {len(lines)} events "
                  f"(exit {tail_rc}); metrics:", file=sys.stderr)
            with __import__("urllib.request").request.urlopen(ep["http"] + "/metrics", timeout=5) as resp:
                for line in resp.read().decode().splitlines():
                    if line.startswith(("kvcr_pages{", "kvcr_event_batches_total", "kvcr_hits_total")):
                        print("      " + line, file=sys.stderr)
            ok = rc == 0 and tail_rc == 0 and stored == pages
            print("demo: OK" if ok else "demo: FAILED", file=sys.stderr)
            return 0 if ok else 1
        finally:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(15)
            except subprocess.TimeoutExpired:
                serve.kill()
            log.close()
            if os.environ.get("KVCR_DEMO_KEEP_LOG"):
                print(Path(tmp, "serve.log").read_text(), file=sys.stderr)
