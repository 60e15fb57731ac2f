"""Dynamo 1.6.1's unmodified frontend and KV router over real `kvcr worker --dynamo` processes.

File discovery, a TCP request plane and a ZMQ event plane, all under the test's own directory;
Dynamo's own index is read through `probe.py` (a `KvRouter` from its bindings).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvcr.demo.httpc import get_json, http
from kvcr.demo.procs import Child
from router_hints.text import TextTokenizer
from tests.cluster import SMALL_MODEL
from tests.conftest import ROOT, wait_until
from tests.dynamo import free_port

BLOCK = 16
MODEL = "kvcr-tiny-l2-h64-s0"  # the worker's name for SMALL_MODEL with seed 0
NAMESPACE = "kvcr"
PROBE = Path(__file__).with_name("probe.py")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.dynamo_frontend)


TOKENIZER = TextTokenizer()  # the kvcr worker's bundled one: Dynamo's frontend tokenizes the same


def prompt(tag: str, words: int = 120) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


def full_blocks(text: str) -> int:
    return len(TOKENIZER.encode(text)) // BLOCK


def dynamo_python() -> str:
    python = os.environ.get("KVCR_DYNAMO_PYTHON", str(ROOT / ".venv-dynamo" / "bin" / "python"))
    assert Path(python).exists(), f"Dynamo's environment is missing ({python}); run `make dynamo-setup`"
    return python


class Etcd:
    """Debian's etcd-server (3.4), as Dynamo's discovery backend across hosts."""

    def __init__(self, tmp: Path) -> None:
        exe = shutil.which("etcd")
        assert exe, "etcd is missing: `make dynamo-system-deps` installs Debian's etcd-server"
        client, peer = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{client}"
        self.log = open(tmp / "etcd.log", "a")
        self.proc = subprocess.Popen([exe, "--name", "kvcr-test", "--data-dir", str(tmp / "etcd"),
                                      "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                                      "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                      "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                                      "--initial-cluster", f"kvcr-test=http://127.0.0.1:{peer}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(self._healthy, 30, 0.2, "etcd /health")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"etcd exited with {self.proc.returncode}")
        try:
            return json.loads(http(self.endpoint + "/health", timeout_s=2)[2]).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(params=["file"])
def discovery(request, tmp_path):
    """Dynamo's discovery backend: "file" (one host); a test takes "etcd" too with
    `@pytest.mark.parametrize("discovery", ["file", "etcd"], indirect=True)`."""
    if request.param == "file":
        yield {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp_path / "discovery")}
        return
    etcd = Etcd(tmp_path)
    try:
        yield {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": etcd.endpoint}
    finally:
        etcd.stop()


@pytest.fixture
def dyn_env(discovery) -> dict:
    """Dynamo's variables for one test: its own discovery store, so tests never see each other."""
    return {**os.environ, **discovery, "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
            "DYN_RUNTIME_NUM_WORKER_THREADS": "2", "DYN_COMPUTE_THREADS": "1", "DYN_SELF_HOST_METADATA": "0",
            "KVCR_DYNAMO_PYTHON": dynamo_python()}


class Frontend:
    """`python -m dynamo.frontend --router-mode kv`, as an operator starts it."""

    def __init__(self, tmp: Path, env: dict, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"frontend-{self.port}.log"
        self.args = [dynamo_python(), "-m", "dynamo.frontend", "--router-mode", "kv", "--http-port", str(self.port),
                     "--discovery-backend", env["DYN_DISCOVERY_BACKEND"], "--request-plane", "tcp", "--event-plane", "zmq",
                     "--kv-cache-block-size", str(BLOCK), "--router-event-threads", "1", *extra]
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Frontend":
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        wait_until(self._up, 60, 0.2, "the Dynamo frontend's HTTP port")
        return self

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the frontend exited: {self.log_path.read_text()[-3000:]}")
        try:
            return http(self.url + "/health", timeout_s=2)[0] == 200
        except OSError:
            return False

    def models(self) -> list[str]:
        return [m["id"] for m in get_json(self.url + "/v1/models")["data"]]

    def complete(self, prompt: str, max_tokens: int = 4, **extra) -> dict:
        status, _, body = http(self.url + "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                              "max_tokens": max_tokens, **extra}, timeout_s=180)
        assert status == 200, body[:500]
        return json.loads(body)

    def selections(self) -> list[dict]:
        """Dynamo's own account of each routing decision: the worker and what it held by tier."""
        text = ANSI.sub("", self.log_path.read_text(errors="replace"))
        return [{k: v.strip('"') for k, v in FIELD.findall(line)} for line in text.splitlines()
                if "Selected worker" in line]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Probe:
    """Dynamo's index, from a KvRouter of its own (it follows the same event plane as the frontend)."""

    def __init__(self, tmp: Path, env: dict) -> None:
        self.log = open(tmp / "probe.log", "a")
        self.proc = subprocess.Popen([dynamo_python(), str(PROBE), f"{NAMESPACE}.backend.generate", str(BLOCK)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     text=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def overlaps(self, tokens: list[int]) -> dict[tuple[int, int], dict]:
        """(Dynamo worker id, DP rank) -> blocks of `tokens` Dynamo believes it holds, by tier."""
        self.proc.stdin.write(json.dumps(tokens) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return {(int(w["worker_id"]), int(w["dp_rank"])): {"host": w["host_pinned_blocks"], "disk": w["disk_blocks"],
                                                           "device": w["device_blocks"]}
                for w in answer["workers"]}

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class DynamoWorker(Child):
    """`kvcr worker --dynamo`: the worker, its runner and its Dynamo bridge (a child that dies with it)."""

    def __init__(self, tmp: Path, name: str, env: dict, *extra: str) -> None:
        super().__init__(tmp, name, ["worker", "--name", name, "--port", "0", *SMALL_MODEL, "--dynamo",
                                     "--dynamo-oracle", "--dynamo-namespace", NAMESPACE,
                                     "--set", f"runner.state_dir={tmp / (name + '.state')}",
                                     "--set", "dram.size=32Mi", *extra], env=env, cwd=ROOT)
        self.bridge_file = Path(str(self.info_file) + ".dynamo")

    def start(self) -> "DynamoWorker":
        self.bridge_file.unlink(missing_ok=True)
        super().start()
        self.wait_ready(120)
        wait_until(lambda: self.bridge_file.exists() or self.proc.poll() is not None, 90, 0.1,
                   f"{self.name}'s Dynamo registration")
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
        self.dynamo_id = json.loads(self.bridge_file.read_text())["worker_id"]
        return self

    def stats(self) -> dict:
        return get_json(self.url + "/server_info")

    def served(self) -> int:
        return self.stats()["stats"]["requests"]

    def held(self, probe: "Probe", text: str) -> dict:
        """What Dynamo's index says this worker holds of `text`, by tier ({} if it does not know it)."""
        return probe.overlaps(TOKENIZER.encode(text)).get((self.dynamo_id, 0), {})

    def claims_held(self) -> float:
        text = http(self.info["kvcr_runner"]["endpoints"]["http"] + "/metrics")[2].decode()
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvcr_claims_held "))


@pytest.fixture
def dynamo(tmp_path, dyn_env):
    """Start frontends, workers and probes; everything is stopped at the end, workers first."""
    started: dict[str, list] = {"workers": [], "frontends": [], "probes": []}

    class Cluster:
        env = dyn_env

        @staticmethod
        def frontend(*extra: str) -> Frontend:
            fe = Frontend(tmp_path, dyn_env, *extra).start()
            started["frontends"].append(fe)
            return fe

        @staticmethod
        def worker(name: str, *extra: str) -> DynamoWorker:
            w = DynamoWorker(tmp_path, name, dyn_env, *extra)
            started["workers"].append(w)
            return w.start()

        @staticmethod
        def probe() -> Probe:
            p = Probe(tmp_path, dyn_env)
            started["probes"].append(p)
            return p

    yield Cluster
    for w in started["workers"]:
        w.stop(signal.SIGTERM, 20)
    for p in started["probes"]:
        p.close()
    for fe in started["frontends"]:
        fe.stop()


@pytest.fixture
def pair(dynamo):
    """A frontend, two `kvcr worker --dynamo` (wa, wb) both known to Dynamo's router, and a probe."""
    fe = dynamo.frontend()
    workers = [dynamo.worker("wa"), dynamo.worker("wb")]
    probe = dynamo.probe()
    wait_for(lambda: len(probe.overlaps(TOKENIZER.encode("warm up"))) == 2, 60, "both workers in Dynamo's router")
    return fe, workers, probe


def first_holder(fe: Frontend, workers: list, probe: Probe, text: str) -> tuple:
    """Send `text` through Dynamo; (the worker it chose, the other one), once Dynamo indexed the pages."""
    fe.complete(text)
    holder = next(w for w in workers if w.served() == 1)
    wait_for(lambda: holder.held(probe, text).get("host") == full_blocks(text), 10, "the prefix in Dynamo's index")
    return holder, next(w for w in workers if w is not holder)


@contextlib.contextmanager
def busy(fe: Frontend, worker: DynamoWorker, prefix: str):
    """A long request sharing `prefix` in flight on `worker` (its holder): Dynamo counts its blocks as
    load, so a short request on the prefix goes to the other worker, with a hint naming this one."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fe.complete(prefix + " " + " ".join(f"tail{i}" for i in range(700)), max_tokens=200, ignore_eos=True)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_for(lambda: worker.stats()["inflight"] >= 1 or not thread.is_alive(), 60, f"{worker.name} busy")
        yield
    finally:
        thread.join(300)
    assert not errors, errors


def wait_for(fn, timeout_s: float, message: str, interval_s: float = 0.25):
    """Poll `fn` until it returns something truthy; returns it."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {message} (last: {value!r})")
        time.sleep(interval_s)
