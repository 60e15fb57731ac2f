"""Dynamo's processes on one machine, for the tests, the benchmark and the demo.

Dynamo's unmodified frontend (`python -m dynamo.frontend --router-mode kv`), Debian's etcd as its
discovery across hosts, and a probe of Dynamo's own index (`kvcr/dynamo/probe.py`, a `KvRouter`
from Dynamo's bindings following the same event plane as the frontend's router).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import socket
import subprocess
import time
from pathlib import Path

from ..demo.httpc import get_json, http
from .launch import bridge_file, dynamo_python, stop_process

PROBE = Path(__file__).with_name("probe.py")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(fn, timeout_s: float, message: str, interval_s: float = 0.2):
    """`fn()` once it is truthy; TimeoutError naming `message` (and the last value) otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {message} (last: {value!r})")
        time.sleep(interval_s)


def await_registration(worker, timeout_s: float = 90.0) -> int:
    """The Dynamo worker id of a started `kvcr worker --dynamo` (a kvcr.demo.procs.Child), once its
    bridge registered; RuntimeError if the worker exited instead."""
    ready = bridge_file(worker.info_file)
    poll(lambda: ready.exists() or worker.proc.poll() is not None, timeout_s, f"{worker.name}'s Dynamo registration")
    if worker.proc.poll() is not None:
        raise RuntimeError(f"{worker.name} exited with {worker.proc.returncode}: "
                           f"{worker.log_path.read_text(errors='replace')[-2000:]}")
    return json.loads(ready.read_text())["worker_id"]


def served_record(worker_urls: dict[str, str], response_id: str) -> tuple[str, dict] | None:
    """(worker name, what serving it took) for a Dynamo response id (`cmpl-<id>`, `chatcmpl-<id>`):
    the bridge hands Dynamo's id to the engine as its rid, which the kvcr worker keeps."""
    rid = response_id.split("-", 1)[1]
    for name, url in worker_urls.items():
        status, _, raw = http(f"{url}/kvcr/served/{rid}")
        if status == 200:
            return name, json.loads(raw)
    return None


def dynamo_env(discovery: dict, base: dict | None = None) -> dict:
    """Dynamo's variables on this machine: `discovery` (file or etcd), TCP requests, ZMQ events, two threads."""
    return {**(base if base is not None else os.environ), **discovery, "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq", "DYN_RUNTIME_NUM_WORKER_THREADS": "2", "DYN_COMPUTE_THREADS": "1",
            "DYN_SELF_HOST_METADATA": "0", "KVCR_DYNAMO_PYTHON": dynamo_python()}


def file_discovery(directory: Path) -> dict:
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(directory)}


class Etcd:
    """Debian's etcd-server (3.4, which Dynamo 1.6.1's client speaks) on loopback ports."""

    def __init__(self, run_dir: Path) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            raise FileNotFoundError("etcd is missing: `make dynamo-system-deps` installs Debian's etcd-server")
        client, peer = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{client}"
        self.log = open(run_dir / "etcd.log", "a")
        self.proc = subprocess.Popen([exe, "--name", "kvcr", "--data-dir", str(run_dir / "etcd"),
                                      "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                                      "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                      "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                                      "--initial-cluster", f"kvcr=http://127.0.0.1:{peer}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        try:
            poll(self._healthy, 30, "etcd /health")
        except BaseException:
            self.stop()
            raise

    @property
    def discovery(self) -> dict:
        return {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": self.endpoint}

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited with {self.proc.returncode}")
        try:
            return json.loads(http(self.endpoint + "/health", timeout_s=2)[2]).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        stop_process(self.proc, 15.0)
        self.log.close()


class Frontend:
    """`python -m dynamo.frontend --router-mode kv`, as an operator starts it."""

    def __init__(self, run_dir: Path, env: dict, *extra: str, block_size: int = 16) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = run_dir / f"frontend-{self.port}.log"
        self.args = [dynamo_python(), "-m", "dynamo.frontend", "--router-mode", "kv", "--http-port", str(self.port),
                     "--discovery-backend", env["DYN_DISCOVERY_BACKEND"], "--request-plane", "tcp",
                     "--event-plane", "zmq", "--kv-cache-block-size", str(block_size), "--router-event-threads", "1",
                     *extra]
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Frontend":
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        try:
            poll(self._up, 60, "the Dynamo frontend's HTTP port")
        except BaseException:
            self.stop()
            raise
        return self

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the frontend exited: {self.log_path.read_text()[-3000:]}")
        try:
            return http(self.url + "/health", timeout_s=2)[0] == 200
        except OSError:
            return False

    def models(self) -> list[str]:
        return [m["id"] for m in get_json(self.url + "/v1/models")["data"]]

    def complete(self, model: str, prompt: str, max_tokens: int = 4, **extra) -> dict:
        status, _, body = http(self.url + "/v1/completions", {"model": model, "prompt": prompt,
                                                              "max_tokens": max_tokens, **extra}, timeout_s=240)
        if status != 200:
            raise RuntimeError(f"the frontend answered {status}: {body[:500]!r}")
        return json.loads(body)

    def selections(self) -> list[dict]:
        """Dynamo's own account of each routing decision (its log): the worker, what it held by tier."""
        text = ANSI.sub("", self.log_path.read_text(errors="replace"))
        return [{k: v.strip('"') for k, v in FIELD.findall(line)} for line in text.splitlines()
                if "Selected worker" in line]

    def metric_sums(self, family: str) -> dict[str, float]:
        """A counter family of the frontend's /metrics, summed over the worker labels."""
        out: dict[str, float] = {}
        for line in http(self.url + "/metrics")[2].decode().splitlines():
            if line.startswith(family + "{"):
                labels = dict(kv.split("=", 1) for kv in line[len(family) + 1:line.index("}")].split(","))
                key = ",".join(f"{k}={v.strip(chr(34))}" for k, v in sorted(labels.items())
                               if k not in ("worker_id", "dynamo_component", "dynamo_namespace", "router_id"))
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 15.0)
            self.log.close()


class Probe:
    """Dynamo's index, from a KvRouter of its own (it follows the same event plane as the frontend)."""

    def __init__(self, run_dir: Path, env: dict, endpoint: str, block_size: int = 16) -> None:
        self.log = open(run_dir / "probe.log", "a")
        self.proc = subprocess.Popen([dynamo_python(), str(PROBE), endpoint, str(block_size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     text=True)
        try:
            if self._answer(60.0) != {"ready": True}:
                raise RuntimeError(f"the probe did not start (see {run_dir / 'probe.log'})")
        except BaseException:
            self.close()
            raise

    def _answer(self, timeout_s: float) -> dict:
        """The probe's next line, or TimeoutError (a stuck probe must not hang the caller)."""
        if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            raise TimeoutError(f"Dynamo's index probe gave no answer within {timeout_s} s")
        return json.loads(self.proc.stdout.readline() or "{}")

    def overlaps(self, tokens: list[int], cache_namespace: str | None = None) -> dict[tuple[int, int], dict]:
        """(Dynamo worker id, DP rank) -> leading blocks of `tokens` Dynamo believes it holds: on
        device, host-pinned, and host-pinned or disk ("disk", as Dynamo reports it). A salted
        request's blocks are only found under its `cache_namespace` (the salt)."""
        self.proc.stdin.write(json.dumps({"tokens": tokens, "cache_namespace": cache_namespace}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(30.0)
        return {(int(w["worker_id"]), int(w["dp_rank"])): {"host": w["host_pinned_blocks"], "disk": w["disk_blocks"],
                                                           "device": w["device_blocks"]}
                for w in answer["workers"]}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
