"""Where a live engine's kvcr hit spends its time: py-spy samples the scheduler (its every thread)
during one 2k-token local hit with the bench model, and the busy samples are split into SGLang's
attention, the CPU harness's device<->host copies, and kvcr (backend, runner, copies). Also prints
the engine's own HiCache metrics (`--enable-metrics`).

    .venv/bin/pip install py-spy && .venv/bin/python bench/sglang_live_profile.py
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvcr.drivers.ucx_env import SINGLE_HOST_UCX_ENV  # noqa: E402

IDLE = ("poll", "wait", "select", "on_idle", "sleep")


def shares(raw: Path) -> dict[str, float]:
    """Busy samples (leaf not waiting) by owner, as fractions."""
    busy, by = 0, {"SGLang attention": 0, "CPU harness copies": 0, "kvcr": 0}
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        if any(x in stack.split(";")[-1] for x in IDLE):
            continue
        busy += int(n)
        if "sdpa" in stack:
            by["SGLang attention"] += int(n)
        if "kvcr_sglang_cpu" in stack:
            by["CPU harness copies"] += int(n)
        if "sglang_adapter/storage" in stack or "kvcr/" in stack.replace("kvcr_sglang_cpu", ""):
            by["kvcr"] += int(n)
    return {k: v / busy for k, v in by.items()} | {"busy samples": busy}


def main() -> int:
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    for k, v in SINGLE_HOST_UCX_ENV.items():
        os.environ.setdefault(k, v)
    import psutil

    from sglang_adapter.cpu_harness.model import KV_LIKE_8B, build_model, prompt_text
    from sglang_adapter.cpu_harness.server import LiveServer

    tmp = Path(tempfile.mkdtemp(prefix="kvcr-profile-"))
    model = build_model(tmp / "model", shape=KV_LIKE_8B, max_tokens=4096)
    s = LiveServer(tmp, "P", model, runner={"dram.size": "512Mi"},
                   args=["--hicache-storage-prefetch-policy", "wait_complete", "--max-total-tokens", "3072",
                         "--enable-metrics"])
    s.start().wait_ready(600)
    try:
        body = {"text": prompt_text(5, 2047), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        s.post("/generate", body, timeout_s=600)
        while len(s.stored_hashes()) < 127:
            time.sleep(0.5)
        s.flush()
        sched = next(p for p in psutil.Process(s.proc.pid).children(recursive=True)
                     if "scheduler" in " ".join(p.cmdline()))
        raw = tmp / "profile.txt"
        rec = subprocess.Popen([spy, "record", "-p", str(sched.pid), "-r", "200", "--threads", "--nonblocking",
                                "-f", "raw", "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)
        t0 = time.perf_counter()
        meta = s.post("/generate", body, timeout_s=600)["meta_info"]
        print(f"local hit: TTFT {time.perf_counter() - t0:.2f} s, cached {meta['cached_tokens']} "
              f"({meta.get('cached_tokens_details')})")
        time.sleep(1)
        rec.send_signal(signal.SIGINT)
        rec.wait(60)
        for k, v in shares(raw).items():
            print(f"  {k}: {v:.1%}" if isinstance(v, float) else f"  {k}: {v}")
        print("\n".join(line for line in s.get("/metrics").splitlines()
                        if "hicache" in line and not line.startswith("#")))
    finally:
        s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
