"""Dynamo's standalone indexer (ai-dynamo-runtime 1.6.1) as a real consumer of our event stream."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.helpers import ROOT, wait_until

BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode()}


def start_indexer(tmp_path_factory):
    python = os.environ.get("KVCR_DYNAMO_PYTHON", str(ROOT / ".venv-dynamo" / "bin" / "python"))
    assert Path(python).exists(), f"Dynamo's indexer environment is missing ({python}); run `make dynamo-setup`"
    port = free_port()
    log = open(tmp_path_factory.mktemp("indexer") / "indexer.log", "w")
    proc = subprocess.Popen([python, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
                            stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return urllib.request.urlopen(url + "/health", timeout=1).status == 200
        except OSError:
            return proc.poll() is not None and pytest.fail("indexer exited")

    wait_until(healthy, 30, 0.2, "indexer /health")
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


class Registration:
    def __init__(self, indexer: str, info: dict) -> None:
        self.indexer = indexer
        self.model = f"kvcr-test-{uuid.uuid4().hex[:8]}"
        self.instance_id = uuid.uuid4().int % 1_000_000  # the indexer keys workers by id across models
        self.info = info

    def register(self, info: dict) -> None:
        self.info = info
        status, body = _post(self.indexer + "/register", {
            "instance_id": self.instance_id, "endpoint": info["endpoints"]["events"], "model_name": self.model,
            "block_size": BLOCK, "dp_rank": info["dp_rank"], "replay_endpoint": info["endpoints"]["replay"]})
        assert status == 201, body

    def query(self, tokens: list[int]) -> dict:
        status, body = _post(self.indexer + "/query", {"token_ids": tokens, "model_name": self.model})
        return body.get("instances", {}).get(str(self.instance_id), {}) if status == 200 else {}

    def wait_for(self, tokens, *, cpu: int, timeout_s: float = 20.0) -> dict:
        return wait_until(lambda: (q := self.query(tokens)) and q.get("cpu", 0) == cpu and q or
                          (cpu == 0 and not q.get("cpu") and {"cpu": 0}), timeout_s, 0.2, f"cpu == {cpu}")


def registered_runner(indexer: str, runner_factory, **overrides):
    """A runner on fixed event ports (they survive its restarts), registered with the indexer."""
    ports = {"events.endpoint": f"tcp://127.0.0.1:{free_port()}",
             "events.replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    proc = runner_factory(**{"dram.pools": [{"name": "kv", "page_bytes": 4096}], **ports, **overrides})
    info = proc.start()
    reg = Registration(indexer, info)
    reg.register(info)
    time.sleep(2.0)  # the indexer's SUB connects asynchronously (slow joiner)
    return proc, info, reg
