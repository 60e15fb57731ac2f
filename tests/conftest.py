import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcr.drivers.ucx_env import SINGLE_HOST_UCX_ENV

# UCX on one host, as ucx-notes recommend for tests (set before any child process starts).
for _k, _v in SINGLE_HOST_UCX_ENV.items():
    os.environ.setdefault(_k, _v)

ROOT = Path(__file__).resolve().parent.parent
VECTORS = json.loads((ROOT.parent / "shared" / "reference" / "hash-vectors.json").read_text()) \
    if (ROOT.parent / "shared" / "reference" / "hash-vectors.json").exists() else None


class RunnerProcess:
    """A real `kvcr serve` child process, discovered through its info file (never its stdout)."""

    def __init__(self, tmp: Path, name: str, overrides: dict) -> None:
        self.tmp = tmp
        self.info_file = tmp / f"{name}.info.json"
        self.log_path = tmp / f"{name}.log"
        self.args = [sys.executable, "-m", "kvcr.cli", "serve", "--info-file", str(self.info_file)]
        defaults = {"runner.name": name, "runner.state_dir": str(tmp / f"{name}.state"), "dram.size": "32Mi"}
        for key, value in {**defaults, **overrides}.items():
            self.args += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self, timeout_s: float = 30.0) -> dict:
        self.info_file.unlink(missing_ok=True)
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=self.log, cwd=ROOT)
        deadline = time.monotonic() + timeout_s
        while not self.info_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvcr serve exited {self.proc.returncode}: {self.log_path.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(self.log_path.read_text())
            time.sleep(0.05)
        self.info = json.loads(self.info_file.read_text())
        return self.info

    @property
    def endpoints(self) -> dict:
        return self.info["endpoints"]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.log.close()


@pytest.fixture
def runner_factory(tmp_path):
    started: list[RunnerProcess] = []

    def make(name: str = "r0", **overrides) -> RunnerProcess:
        proc = RunnerProcess(tmp_path, name, overrides)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        if proc.proc is not None and proc.proc.poll() is None:
            try:
                proc.stop(signal.SIGTERM, timeout_s=10)
            except subprocess.TimeoutExpired:
                proc.proc.kill()


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05, message: str = "condition"):
    """Poll until `predicate()` is truthy (returns it) or fail naming the condition."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{message} not reached within {timeout_s} s (last: {last!r})")


def vectors(algorithm_prefix: str) -> list:
    assert VECTORS is not None, "shared/reference/hash-vectors.json is missing beside the checkout"
    return [pytest.param(v, id=v["id"]) for v in VECTORS["vectors"] if v["algorithm"].startswith(algorithm_prefix)]


def _owner_alive(name: str) -> bool:
    parts = name.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(autouse=True)
def _no_stray_shm():
    """A region whose owner is gone but whose file remains was leaked (a live owner's is in use,
    perhaps by another suite on this host)."""
    before = set(os.listdir("/dev/shm"))
    yield
    leaked = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("kvcr-") and not _owner_alive(n)}
    assert not leaked, f"shared-memory regions left behind: {leaked}"


@pytest.fixture(scope="session")
def indexer(tmp_path_factory):
    """One Dynamo indexer for the whole session; each test registers its own model name."""
    from tests.dynamo import start_indexer
    yield from start_indexer(tmp_path_factory)


@pytest.fixture
def backends():
    """KVCRStorage backends on real SGLang host pools, closed after the test."""
    from tests.sglang_pools import make_backend

    made = []

    def make(pool, mla: bool = False, **extra):
        made.append(make_backend(pool, mla, **extra))
        return made[-1]

    yield make
    for b in made:
        b.close()
