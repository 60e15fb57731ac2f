"""What tests share besides fixtures: the repository's root, the hash vectors, a runner process,
polling. Test modules import these; fixtures stay in conftest.py."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from kvcr.demo.procs import Child


ROOT = Path(__file__).resolve().parent.parent


VECTORS = json.loads((ROOT.parent / "shared" / "reference" / "hash-vectors.json").read_text()) \
    if (ROOT.parent / "shared" / "reference" / "hash-vectors.json").exists() else None


class RunnerProcess(Child):
    """A real `kvcr serve` child process, discovered through its info file (never its stdout)."""

    def __init__(self, tmp: Path, name: str, overrides: dict, *, env: dict | None = None, wrap=()) -> None:
        defaults = {"runner.name": name, "runner.state_dir": str(tmp / f"{name}.state"), "dram.size": "32Mi"}
        sets = [arg for key, value in {**defaults, **overrides}.items()
                for arg in ("--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}")]
        super().__init__(tmp, name, ["serve", *sets], env=env, cwd=ROOT, wrap=wrap)

    def start(self, timeout_s: float = 30.0) -> dict:
        return super().start().wait_ready(timeout_s)

    @property
    def endpoints(self) -> dict:
        return self.info["endpoints"]


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


def runner_info(control: str, incarnation: str = "i1", digest: str = "ns1") -> dict:
    """A runner's public info as a peers registry holds it (the fields a peer reads)."""
    return {"incarnation": incarnation, "events_curve": False,
            "endpoints": {"control": control, "events": control.replace("56", "57"), "replay": None},
            "pools": [{"name": "kv", "namespace_digest": digest}]}


def stop(proc) -> None:
    """SIGSTOP `proc` and wait until every thread of it is stopped: under load the kernel takes a
    moment to stop them all, and a test that counts on a frozen process must not race that."""
    proc.send_signal(signal.SIGSTOP)

    def frozen() -> bool:
        try:
            tasks = os.listdir(f"/proc/{proc.pid}/task")
            states = [open(f"/proc/{proc.pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] for t in tasks]
        except FileNotFoundError:  # a thread ended while we looked: look again
            return False
        return all(s in ("T", "t") for s in states)

    wait_until(frozen, 10, 0.005, f"process {proc.pid} stopped")
