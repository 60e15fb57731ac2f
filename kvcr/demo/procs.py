"""Child `kvcr` processes found through the info file each writes once it is up."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence


class Child:
    def __init__(self, run_dir: Path, name: str, args: list[str], env: dict | None = None,
                 cwd: Path | None = None, wrap: Sequence[str] = ()) -> None:
        """`wrap` prefixes the command (e.g. nsenter into a test host); it must exec, not fork."""
        self.name = name
        self.cwd = cwd
        self.info_file = run_dir / f"{name}.info.json"
        self.log_path = run_dir / f"{name}.log"
        self.args = [*wrap, sys.executable, "-m", "kvcr.cli", *args, "--info-file", str(self.info_file)]
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self) -> "Child":
        self.info_file.unlink(missing_ok=True)
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=self.log, env=self.env, cwd=self.cwd)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.info_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not come up within {timeout_s:.0f} s:\n"
                                   f"{self.log_path.read_text()[-4000:]}")
            time.sleep(0.05)
        self.info = json.loads(self.info_file.read_text())
        return self.info

    @property
    def url(self) -> str:
        return self.info["url"]

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        """Wait for the exit (killing it after `timeout_s`); returns the exit code."""
        if self.proc is None:
            return 0
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()  # closing twice is harmless

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.proc is None:
            return 0
        self.send_signal(sig)
        return self.wait(timeout_s)


def worker_command(name: str, base: Path, *, page_size: int, layers: int, hidden: int, seed: int, dram: str,
                   transport: str, nvme: bool = True) -> list[str]:
    """`kvcr worker` arguments for one engine of a local cluster (the demo's, the live replay's):
    state (and NVMe) under `base`, any free port."""
    args = ["worker", "--name", name, "--port", "0", "--page-size", str(page_size), "--layers", str(layers),
            "--hidden", str(hidden), "--seed", str(seed), "--set", f"runner.state_dir={base / 'state'}",
            "--set", f"dram.size={dram}", "--set", f"runner.transfer={transport}"]
    if nvme:  # evict written-behind pages before DRAM is full, so a fill rarely waits for the writer
        args += ["--set", f"nvme.storage_dir={base / 'nvme'}", "--set", "dram.high_watermark=0.85",
                 "--set", "dram.low_watermark=0.7"]
    return args


def stop_all(children: list[Child], timeout_s: float = 8.0) -> None:
    """Signal every child first, then wait: shutdown takes the time of the slowest, not the sum."""
    for child in children:
        child.send_signal()
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.wait(max(0.1, deadline - time.monotonic()))
