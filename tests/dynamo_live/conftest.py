"""Dynamo 1.6.1's unmodified frontend and KV router over real `kvcr worker --dynamo` processes.

File (or etcd) discovery, a TCP request plane and a ZMQ event plane, all under the test's own
directory; Dynamo's own index is read through kvcr/dynamo/probe.py (a `KvRouter` from its bindings).
The processes are kvcr/dynamo/local.py's.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import pytest

from kvcr.demo.httpc import get_json, http
from kvcr.demo.procs import Child
from kvcr.dynamo import local
from kvcr.dynamo.local import Etcd, Probe, await_registration, dynamo_env, file_discovery
from kvcr.dynamo.local import poll as wait_for
from tests.cluster import SMALL_MODEL
from tests.dynamo_live.helpers import BLOCK, MODEL, NAMESPACE, TOKENIZER  # noqa: F401
from tests.helpers import ROOT


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.dynamo_frontend)


@pytest.fixture(params=["file"])
def discovery(request, tmp_path):
    """Dynamo's discovery backend: "file" (one host); a test takes "etcd" too with
    `@pytest.mark.parametrize("discovery", ["file", "etcd"], indirect=True)`."""
    if request.param == "file":
        yield file_discovery(tmp_path / "discovery")
        return
    etcd = Etcd(tmp_path)
    try:
        yield etcd.discovery
    finally:
        etcd.stop()


@pytest.fixture
def dyn_env(discovery) -> dict:
    """Dynamo's variables for one test: its own discovery store, so tests never see each other."""
    return dynamo_env(discovery)


class Frontend(local.Frontend):
    def complete(self, prompt: str, max_tokens: int = 4, **extra) -> dict:
        return super().complete(MODEL, prompt, max_tokens, **extra)


class DynamoWorker(Child):
    """`kvcr worker --dynamo`: the worker, its runner and its Dynamo bridge (a child that dies with it)."""

    def __init__(self, tmp: Path, name: str, env: dict, *extra: str) -> None:
        super().__init__(tmp, name, ["worker", "--name", name, "--port", "0", *SMALL_MODEL, "--dynamo",
                                     "--dynamo-oracle", "--dynamo-namespace", NAMESPACE,
                                     "--set", f"runner.state_dir={tmp / (name + '.state')}",
                                     "--set", "dram.size=32Mi", *extra], env=env, cwd=ROOT)

    def start(self) -> "DynamoWorker":
        super().start()
        self.wait_ready(120)
        self.dynamo_id = await_registration(self)
        return self

    def stats(self) -> dict:
        return get_json(self.url + "/server_info")

    def served(self) -> int:
        return self.stats()["stats"]["requests"]

    def held(self, probe: "Probe", text: str, salt: str | None = None) -> dict:
        """What Dynamo's index says this worker holds of `text` (under `salt`), by tier ({} if it
        does not know it)."""
        return probe.overlaps(TOKENIZER.encode(text), salt).get((self.dynamo_id, 0), {})

    def claims_held(self) -> float:
        text = http(self.info["kvcr_runner"]["endpoints"]["http"] + "/metrics")[2].decode()
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvcr_claims_held "))


@pytest.fixture
def dynamo(tmp_path, dyn_env):
    """Start frontends, workers and probes; all are stopped at the end, the latest started first,
    every stop running even if another fails."""
    with contextlib.ExitStack() as stack:
        class Cluster:
            env = dyn_env

            @staticmethod
            def frontend(*extra: str) -> Frontend:
                fe = Frontend(tmp_path, dyn_env, *extra, block_size=BLOCK).start()
                stack.callback(fe.stop)
                return fe

            @staticmethod
            def worker(name: str, *extra: str) -> DynamoWorker:
                w = DynamoWorker(tmp_path, name, dyn_env, *extra)
                stack.callback(w.stop, signal.SIGTERM, 20)
                return w.start()

            @staticmethod
            def probe() -> Probe:
                p = Probe(tmp_path, dyn_env, f"{NAMESPACE}.backend.generate", BLOCK)
                stack.callback(p.close)
                return p

        yield Cluster


@pytest.fixture
def pair(dynamo):
    """A frontend, two `kvcr worker --dynamo` (wa, wb) both known to Dynamo's router, and a probe."""
    fe = dynamo.frontend()
    workers = [dynamo.worker("wa"), dynamo.worker("wb")]
    probe = dynamo.probe()
    wait_for(lambda: len(probe.overlaps(TOKENIZER.encode("warm up"))) == 2, 60, "both workers in Dynamo's router")
    return fe, workers, probe


