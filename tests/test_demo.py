"""`kvcr demo` end to end (the CI-sized variant), and its shutdown on Ctrl-C."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until

SMALL = ["--workers", "2", "--conversations", "4", "--turns", "3", "--layers", "2", "--hidden", "64", "--no-live"]


def start_demo(run_dir: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    log = run_dir.parent / f"{run_dir.name}.stderr"
    # Ctrl-C as in a terminal, even when the test run itself was started in the background
    # (a shell's `cmd &` ignores SIGINT, and a child inherits that).
    proc = subprocess.Popen([sys.executable, "-m", "kvcr.cli", "demo", "--run-dir", str(run_dir), *SMALL, *extra],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, log


def leftovers(run_dir: Path, log: Path) -> list[str]:
    """Processes started for this run, its temporary directory, and shared-memory regions of its children."""
    found = []
    ps = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    found += [f"process {pid}" for pid in ps]
    tmp = re.search(r"NVMe in (\S+),", log.read_text())
    if tmp and Path(tmp.group(1)).exists():
        found.append(f"temporary directory {tmp.group(1)}")
    for info in (run_dir / "logs").glob("w*.info.json"):
        shm = json.loads(info.read_text())["kvcr_runner"]["shm_path"]
        if os.path.exists(shm):
            found.append(f"region {shm}")
    return found


def test_the_small_demo_pulls_from_peers_and_every_cached_answer_matches_the_oracle(tmp_path):
    run_dir = tmp_path / "run"
    proc, log = start_demo(run_dir)
    assert proc.wait(300) == 0, log.read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] and not summary["errors"] and summary["problems"] == []
    assert summary["peer_hits"] > 0 and summary["page_sources"]["dram"] > 0
    assert summary["oracle"]["checks"] > 0 and summary["oracle"]["mismatches"] == 0
    assert summary["oracle"]["chunked_bitwise_equal"] == summary["oracle"]["checks"]
    assert summary["oracle"]["max_abs_vs_one_shot"] <= 1e-4
    assert (run_dir / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "demo OK" in log.read_text()
    assert leftovers(run_dir, log) == []


@pytest.mark.parametrize("moment", ["[3/4] workload", "holding"])
def test_ctrl_c_stops_everything_within_ten_seconds(tmp_path, moment):
    run_dir = tmp_path / "run"
    proc, log = start_demo(run_dir, "--hold")
    wait_until(lambda: moment in log.read_text() or proc.poll() is not None, 240, 0.05, moment)
    assert proc.poll() is None, log.read_text()
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(10)
    assert time.monotonic() - start < 10
    assert rc == (0 if moment == "holding" else 130), log.read_text()
    assert leftovers(run_dir, log) == []
