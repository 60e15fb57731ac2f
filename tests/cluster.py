"""Real `kvcr worker` and `kvcr router` processes for the HTTP tests and the demo's tests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A small model keeps the tests quick; pages are 2 layers x K,V x 16 tokens x 64 floats = 16 KiB.
SMALL_MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4"]


class Proc:
    def __init__(self, tmp: Path, name: str, args: list[str]) -> None:
        self.info_file = tmp / f"{name}.info.json"
        self.log_path = tmp / f"{name}.log"
        self.args = [sys.executable, "-m", "kvcr.cli", *args, "--info-file", str(self.info_file)]
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self) -> "Proc":
        self.info_file.unlink(missing_ok=True)
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=self.log, cwd=ROOT)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.info_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[3]} exited {self.proc.returncode}: {self.log_path.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(self.log_path.read_text())
            time.sleep(0.05)
        self.info = json.loads(self.info_file.read_text())
        return self.info

    @property
    def url(self) -> str:
        return self.info["url"]

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()


def worker(tmp: Path, name: str, *extra: str) -> Proc:
    return Proc(tmp, name, ["worker", "--name", name, "--port", "0", *SMALL_MODEL, "--set",
                            f"runner.state_dir={tmp / (name + '.state')}", "--set", "dram.size=16Mi", *extra])


def router(tmp: Path, workers: list[Proc], name: str = "router", **router_keys) -> Proc:
    cfg = {"router": {"port": 0, **router_keys},
           "workers": [{"name": w.info["kvcr_runner"]["name"], "url": w.url} for w in workers]}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return Proc(tmp, name, ["router", "--config", str(path)])


def http(url: str, body: dict | bytes | None = None, headers: dict | None = None, timeout_s: float = 60.0
         ) -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()
