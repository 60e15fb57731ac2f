"""Dynamo 1.6.1's unmodified frontend and KV router over real `kvcr worker --dynamo` processes.

File (or etcd) discovery, a TCP request plane and a ZMQ event plane, all under the test's own
directory; Dynamo's own index is read through kvcr/dynamo/probe.py (a `KvRouter` from its bindings).
The processes are kvcr/dynamo/local.py's.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

import pytest

from kvcr.demo.httpc import get_json, http
from kvcr.demo.procs import Child
from kvcr.dynamo import local
from kvcr.dynamo.local import Etcd, Probe, await_registration, dynamo_env, file_discovery
from kvcr.dynamo.local import poll as wait_for
from kvcr.text import TextTokenizer
from tests.cluster import SMALL_MODEL
from tests.conftest import ROOT

BLOCK = 16
MODEL = "kvcr-tiny-l2-h64-s0"  # the worker's name for SMALL_MODEL with seed 0
NAMESPACE = "kvcr"


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.dynamo_frontend)


TOKENIZER = TextTokenizer()  # the kvcr worker's bundled one: Dynamo's frontend tokenizes the same


def prompt(tag: str, words: int = 120) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


def full_blocks(text: str) -> int:
    return len(TOKENIZER.encode(text)) // BLOCK


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


def salted(salt: str | None) -> dict:
    """A completion's fields for a tenant: Dynamo takes its cache salt in `nvext`."""
    return {"nvext": {"cache_salt": salt}} if salt is not None else {}


def first_holder(fe: Frontend, workers: list, probe: Probe, text: str, salt: str | None = None) -> tuple:
    """Send `text` through Dynamo; (the worker it chose, the other one), once Dynamo indexed the pages."""
    fe.complete(text, **salted(salt))
    holder = next(w for w in workers if w.served() == 1)
    wait_for(lambda: holder.held(probe, text, salt).get("host") == full_blocks(text), 10,
             "the prefix in Dynamo's index")
    return holder, next(w for w in workers if w is not holder)


@contextlib.contextmanager
def busy(fe: Frontend, worker: DynamoWorker, prefix: str, salt: str | None = None):
    """A long request sharing `prefix` in flight on `worker` (its holder): Dynamo counts its blocks as
    load, so a short request on the prefix goes to the other worker, with a hint naming this one."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fe.complete(prefix + " " + " ".join(f"tail{i}" for i in range(700)), max_tokens=600, ignore_eos=True,
                        **salted(salt))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_for(lambda: worker.stats()["inflight"] >= 1 or not thread.is_alive(), 60, f"{worker.name} busy")
        assert thread.is_alive(), f"the long request ended before the test ran: {errors}"
        yield
        assert thread.is_alive(), "the long request ended before the test's request was routed: make it longer"
    finally:
        thread.join(300)
    assert not errors, errors
