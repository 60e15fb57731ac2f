"""Real `python -m sglang_adapter.launch_server` processes on free ports (development only)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site"
VENV = Path(sys.prefix)
# --sleep-on-idle: without it an idle scheduler spins a core (shared/reference/sglang-on-cpu.md).
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
             "--skip-server-warmup", "--sleep-on-idle", "--max-total-tokens", "4096", "--page-size", "16",
             "--mem-fraction-static", "0.5"]


# Ports an engine binds only once it is up (tens of seconds later) are drawn below Linux's
# ephemeral range (32768-60999), where the OS hands out ports to everyone else meanwhile, and
# above 22000-29999, where SGLang draws the ports its own children bind later (nccl_port): one
# such draw took a runner's control port in a full run. Never the same port twice per process.
PORTS = range(30000, 32700)
EPHEMERAL_LOW = 32768
_rng = random.Random()
_given: set[int] = set()


def free_port(span: int = 1) -> int:
    """A free port; with `span`, the first of that many free in a row (a DP engine's ranks bind base + rank)."""
    for _ in range(200):
        port = _rng.choice(PORTS[:len(PORTS) - span + 1])
        ports = range(port, port + span)
        if any(p in _given for p in ports) or not all(_bindable(p) for p in ports):
            continue
        _given.update(ports)
        return port
    raise RuntimeError(f"no {span} free port(s) in a row in {PORTS}")


# Under DP attention SGLang 0.5.23 binds the server port + 233 and the 7 after it (its ZMQ_TCP_PORT_DELTA
# and derived ports): a runner port drawn into that window took the engine down in a full run.
DP_DERIVED_PORTS = range(233, 241)


def server_port(dp_size: int) -> int:
    """A free port for an engine's HTTP server; with DP, one whose derived window is free and kept
    from later draws too."""
    for _ in range(200):
        port = free_port()
        derived = [port + d for d in DP_DERIVED_PORTS] if dp_size > 1 else []
        if (any(p in _given or p >= EPHEMERAL_LOW for p in derived)  # the OS hands those out meanwhile
                or not all(_bindable(p) for p in derived)):
            continue
        _given.update(derived)
        return port
    raise RuntimeError(f"no server port in {PORTS} with its DP ports {DP_DERIVED_PORTS} free")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# KVCR_LIVE_GPU=1 (bench/gpu_smoke.sh): the same engines on a GPU, stock SGLang, nothing patched.
ON_GPU = os.environ.get("KVCR_LIVE_GPU") == "1"
GPU_FLAGS = ["--max-total-tokens", "4096", "--page-size", "16", "--mem-fraction-static", "0.3"]


def harness_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    if not ON_GPU:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    site = () if ON_GPU else (str(SITE),)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*site, str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(VENV / "torch-extensions"))  # SGLang's page hash, built once
    env.update(extra or {})
    return env


class LiveServer:
    """One engine with `--hicache-storage-backend kvcr` and its in-process runner."""

    def __init__(self, run_dir: Path, name: str, model: Path, *, runner: dict | None = None,
                 extra_config: dict | None = None, args: list[str] | None = None, env: dict | None = None,
                 backend: str = "kvcr", peers_dir: str | None = "", python: str = sys.executable) -> None:
        """`python`: the interpreter the engine runs under (another SGLang release's environment)."""
        self.name, self.run_dir, self.model = name, run_dir, model
        self.python = python
        self.args = list(args or [])
        self.dp_size = int(self.args[self.args.index("--dp-size") + 1]) if "--dp-size" in self.args else 1
        self.port = server_port(self.dp_size)
        # SGLang would draw its torch.dist port at random, unchecked against the other engines a test
        # starts at once (one draw collided in a full run): this process hands it out, once.
        self.nccl_port = free_port()
        self.log_path = run_dir / f"{name}.log"
        # fixed ports, so a restarted engine's runner is the same peer to everyone (a DP engine's
        # ranks at these + rank)
        self.endpoints = {k: f"tcp://127.0.0.1:{free_port(self.dp_size)}" for k in ("control", "events", "replay")}
        self.runner_http = f"http://127.0.0.1:{free_port(self.dp_size)}"
        runner = {"runner.name": name, "runner.state_dir": str(run_dir / f"{name}.state"), "dram.size": "16Mi",
                  "runner.control_endpoint": self.endpoints["control"], "events.endpoint": self.endpoints["events"],
                  "events.replay_endpoint": self.endpoints["replay"],
                  "runner.http_port": int(self.runner_http.rsplit(":", 1)[1]), **(runner or {})}
        # with a sidecar the ranks attach to its runner: no embedded one
        # Engines of one harness run are strangers unless a caller gives a peers_dir (None: the
        # backend's default, the user's own directory), so each test and bench row measures what it names.
        own = {} if peers_dir is None else {"peers_dir": peers_dir}
        self.extra = {**({} if (extra_config or {}).get("sidecar") else {"runner": runner, **own}),
                      **(extra_config or {})}
        self.env = dict(env or {})
        self.backend = backend  # "kvcr", or an SGLang backend to compare with ("file")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rank(self, rank: int) -> dict[str, str]:
        """DP rank `rank`'s runner endpoints (control, events, replay, http): the base ports + rank."""
        def shifted(endpoint: str) -> str:
            base, port = endpoint.rsplit(":", 1)
            return f"{base}:{int(port) + rank}"
        return {k: shifted(v) for k, v in {**self.endpoints, "http": self.runner_http}.items()}

    def command(self) -> list[str]:
        # Under plain DP SGLang gives every replica's TP group the --nccl-port: they would collide.
        pure_dp = "--dp-size" in self.args and "--enable-dp-attention" not in self.args
        nccl = [] if pure_dp else ["--nccl-port", str(self.nccl_port)]
        return [self.python, "-m", "sglang_adapter.launch_server", "--model-path", str(self.model),
                "--host", "127.0.0.1", "--port", str(self.port), *nccl,
                *(GPU_FLAGS if ON_GPU else CPU_FLAGS),
                "--hicache-storage-backend", self.backend,
                *(["--hicache-storage-backend-extra-config", json.dumps(self.extra)] if self.backend == "kvcr"
                  else ["--enable-hierarchical-cache"]), *self.args]

    def start(self) -> "LiveServer":
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.command(), stdout=self.log, stderr=subprocess.STDOUT, env=harness_env(self.env),
                                     cwd=ROOT, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> "LiveServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if self.get("/health", timeout_s=2) is not None:
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy within {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def get(self, path: str, timeout_s: float = 30.0):
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            body = r.read()
        return json.loads(body) if body.strip().startswith((b"{", b"[")) else body.decode()

    def post(self, path: str, body: dict, timeout_s: float = 120.0):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
        return json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw.decode()

    def flush(self, timeout_s: float = 30.0) -> None:
        """POST /flush_cache until the engine flushes (it answers 400 while requests still run)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.post("/flush_cache", {})
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 400 or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def stored(self, timeout_s: float = 30.0) -> list:
        """The BlockStored events of its runner's own tiers (a snapshot), chain order; the engine's
        tiers its runner relays are left out."""
        from kvcr.client import ControlClient
        from kvcr.proto.events import RUNNER_MEDIA, BlockStored

        with ControlClient(self.endpoints["control"], timeout_s=timeout_s) as client:
            return [e for e in client.snapshot()[1] if isinstance(e, BlockStored) and e.medium in RUNNER_MEDIA]

    def stored_hashes(self) -> list[int]:
        return [h for e in self.stored() for h in e.block_hashes]

    def runner_get(self, path: str, timeout_s: float = 10.0):
        """GET from the engine's in-process runner (its /info, /metrics)."""
        with urllib.request.urlopen(self.runner_http + path, timeout=timeout_s) as r:
            body = r.read()
        return json.loads(body) if path != "/metrics" else body.decode()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """SIGTERM: to the launcher, which drains and stops its children as an operator's would;
        SIGKILL: to every process of the engine at once (a crash)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            if sig == signal.SIGKILL:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
