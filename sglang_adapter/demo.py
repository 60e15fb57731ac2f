"""`kvcr demo --engine sglang`: the demo's workload on live SGLang 0.5.23 engines with kvcr's
backend (`python -m sglang_adapter.launch_server ... --hicache-storage-backend kvcr`, each with its
in-process runner), behind the same `kvcr router`, checked against a cold reference engine.

The engines come from the development-only CPU harness (sglang_adapter.cpu_harness): a tiny random
Llama built locally, and the patches that let SGLang's CUDA-only host-pool code run on a CPU.
`kvcr demo` finds this variant through the `kvcr.demos` entry point (pyproject.toml): kvcr itself
imports nothing of sglang_adapter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from kvcr.demo.base import Demo, DemoUnavailable, _say
from kvcr.demo.sglang_driver import metric, runner_metrics
from kvcr.drivers.ucx_env import SINGLE_HOST_UCX_ENV

SGLANG_VERSION = "0.5.23"
STOP_S = 8.0  # the router's and driver's grace after SIGTERM (as for the worker variant)
# An engine's grace: SIGTERM to its process group ends its scheduler (and the runner in it) within
# about a second; its launcher process then sleeps 5 s "to let GPU activity settle" before exiting,
# which a CPU engine does not need, so it is killed after this.
ENGINE_STOP_S = 3.0
# The harness's tiny Llama (sglang_adapter.cpu_harness.model) with its weights drawn at std 0.3
# instead of transformers' 0.02: at 0.02 attention is nearly uniform and an answer barely depends
# on its context (one changed prompt token moved the logprobs by 4e-3, the output ids not at all),
# so no oracle could tell right KV from wrong; at 0.3 one changed token moves them by 1-2 and
# changes the output ids (docs/demo.md).
INIT_RANGE = 0.3


class SGLangMissing(DemoUnavailable):
    pass


def installed_sglang() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def require_sglang() -> None:
    """Refuse, naming the fix, when SGLang 0.5.23 (or the harness's transformers) is missing."""
    found = installed_sglang()
    problem = None
    if found is None:
        problem = f"SGLang is not installed in {sys.prefix}"
    elif found != SGLANG_VERSION:
        problem = f"SGLang {found} is installed in {sys.prefix}; kvcr's backend needs {SGLANG_VERSION}"
    else:
        try:
            version("transformers")
        except PackageNotFoundError:
            problem = f"transformers (which SGLang {SGLANG_VERSION} needs) is not installed in {sys.prefix}"
    if problem:
        raise SGLangMissing(f"{problem}. Run `make sglang-setup` (SGLang {SGLANG_VERSION} without its GPU "
                            "dependencies, into .venv), then `.venv/bin/kvcr demo --engine sglang`.")


def prepare() -> type[Demo]:
    """`kvcr demo --engine sglang`'s class, once SGLang 0.5.23 is known to be there (SGLangMissing
    otherwise, naming `make sglang-setup`)."""
    require_sglang()
    return SGLangDemo


def build_demo_model(directory: Path, *, seed: int = 0) -> Path:
    """The harness's tiny Llama and tokenizer (2 layers x 64, bf16, BOS-adding), weights at INIT_RANGE."""
    from sglang_adapter.cpu_harness.model import build_model

    return build_model(directory, seed=seed, init_std=INIT_RANGE)


def build_model_apart(directory: Path, seed: int) -> None:
    """build_demo_model in a process of its own: torch and transformers stay out of the caller's memory."""
    built = subprocess.run([sys.executable, "-m", "sglang_adapter.demo", "build-model", str(directory),
                            str(seed)], capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"building the model failed (exit {built.returncode}):\n{built.stderr[-3000:]}")


def router_config(engines: list, page_size: int, tokenizer: Path) -> dict:
    """`kvcr router`'s config for live engines (LiveServers) with kvcr's backend."""
    return {"router": {"port": 0, "block_size": page_size, "tokenizer": str(tokenizer)},
            "workers": [{"name": e.name, "url": e.url, "engine": "sglang", "runner": e.runner_http} for e in engines]}


def _reference_class():
    from sglang_adapter.cpu_harness import server

    class ReferenceServer(server.LiveServer):
        """Plain SGLang (no kvcr, no hierarchical cache, no radix cache): every prompt computed cold,
        with the harness's engine flags (its GPU ones where it runs on a GPU, untested here)."""

        def command(self) -> list[str]:
            flags = server.GPU_FLAGS if getattr(server, "ON_GPU", False) else server.CPU_FLAGS
            return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model), "--host",
                    "127.0.0.1", "--port", str(self.port), *flags, "--disable-radix-cache", *self.args]

    return ReferenceServer


class SGLangDemo(Demo):
    engine = "sglang"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.engines: list = []  # LiveServers: the workers, then the reference
        self.reference = None
        self.model_dir: Path | None = None
        self.page_bytes: dict[str, int] = {}

    @property
    def workers_(self) -> list:
        """The engines behind the router (not the reference)."""
        return [e for e in self.engines if e is not self.reference]

    @property
    def worker_names(self) -> list[str]:
        return [e.name for e in self.workers_]

    def start(self) -> None:
        from sglang_adapter.cpu_harness.server import LiveServer

        a, logs = self.args, self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for key, value in SINGLE_HOST_UCX_ENV.items():  # the engines inherit the demo's environment
            os.environ.setdefault(key, value)
        start = time.monotonic()
        self.model_dir = self.tmp / "model"
        build_model_apart(self.model_dir, a.seed)
        _say(f"[1/4] starting {a.workers} SGLang {SGLANG_VERSION} engines with kvcr's backend (tiny random Llama "
             f"built in {self.model_dir} in {time.monotonic() - start:.1f} s; runner with DRAM {a.dram} + NVMe in "
             f"{self.tmp}, UCX peer server) and a reference engine for the oracle (--disable-radix-cache, no "
             "hierarchical cache); about 20 s each")
        flags = ["--page-size", str(a.page_size), "--hicache-write-policy", "write_through",
                 "--hicache-storage-prefetch-policy", "wait_complete"]  # backups and cached_tokens deterministic
        for i in range(a.workers):
            name, base = f"w{i}", self.tmp / f"w{i}"
            runner = {"runner.state_dir": str(base / "state"), "nvme.storage_dir": str(base / "nvme"),
                      "dram.size": a.dram, "dram.high_watermark": 0.85, "dram.low_watermark": 0.7,
                      "runner.transfer": a.transport}
            # SGLang reads storage only for a hit of prefetch_threshold tokens or more (default 256);
            # a page is enough here, so every page the router names a source for is fetched
            self.engines.append(LiveServer(logs, name, self.model_dir, runner=runner, args=flags,
                                           extra_config={"prefetch_threshold": a.page_size}))
        self.reference = _reference_class()(logs, "reference", self.model_dir,
                                            args=["--page-size", str(a.page_size)])
        self.engines.append(self.reference)
        for e in self.engines:
            e.start()  # registered first: a failed start is still stopped
        for e in self.engines:
            e.wait_ready()
        _say(f"      engines up after {time.monotonic() - start:.0f} s")
        for e in self.workers_:
            info = e.runner_get("/info")
            self.page_bytes[e.name] = info["pools"][0]["page_bytes"]
            tmp = logs / f"{e.name}.info.json.tmp"  # as a `kvcr worker` writes it: url and runner info
            tmp.write_text(json.dumps({"url": e.url, "kvcr_runner": info}))
            os.replace(tmp, logs / f"{e.name}.info.json")
        cfg = router_config(self.workers_, a.page_size, self.model_dir)
        self.start_router(cfg, logs, "; the model's tokenizer")
        for e in self.workers_:
            _say(f"      {e.name} {e.url}  runner {e.runner_http}/metrics  control {e.endpoints['control']}  "
                 f"events {e.endpoints['events']}")
        _say(f"      reference {self.reference.url}")

    def driver_args(self) -> list[str]:
        return ["--engine", "sglang", "--reference", self.reference.url, "--tokenizer", str(self.model_dir),
                "--page-size", str(self.args.page_size),
                "--runners", ",".join(f"{e.name}={e.runner_http}" for e in self.workers_)]

    def snapshot(self) -> dict[str, dict]:
        """Per engine: its runner's tiers (from its /metrics) and, from the outcomes so far, its requests."""
        outcomes = self.feed.outcomes if self.feed is not None else []
        out = {}
        for e in self.workers_:
            text = runner_metrics(e.runner_http)
            mine = [o for o in outcomes if o.worker == e.name]
            out[e.name] = {
                "tiers": {"dram_pages": int(metric(text, "kvcr_pages", tier="dram", state="ready")),
                          "dram_capacity": int(metric(text, "kvcr_capacity_pages", tier="dram")),
                          "nvme_pages": int(metric(text, "kvcr_pages", tier="nvme", state="ready")),
                          "page_bytes": self.page_bytes[e.name], "events": int(metric(text, "kvcr_events_total"))},
                "stats": {"requests": len(mine), **{f"{k}_pages": sum(getattr(o, f"{k}_pages") for o in mine)
                                                    for k in ("device", "host", "dram", "nvme", "peer")},
                          "saved_s": sum(o.saved_s for o in mine)},
                # the runner's own counts: every page it pulled, and found for itself or for a peer's claim
                "runner": {"runner_pulled_pages": int(metric(text, "kvcr_pulled_pages_total")),
                           "runner_hits": int(metric(text, "kvcr_hits_total"))}}
        return out

    def hold_text(self) -> str:
        w = self.workers_[0].endpoints
        return (f"  kvcr info {w['control']}\n"
                f"  kvcr events tail --endpoint {w['events']} --replay {w['replay']} --snapshot {w['control']}\n"
                f"  curl -s {self.workers_[0].runner_http}/metrics | grep kvcr_pulled\n"
                f"  curl -s {self.router.url}/metrics | grep kvcr_router")

    def stop(self) -> None:
        """SIGTERM to every child and engine (each engine's whole process group) at once, then wait
        with one deadline each; what is left then is killed (well within Ctrl-C's 10 s)."""
        for child in self.children:
            child.send_signal()
        for e in self.engines:
            _signal_group(e, signal.SIGTERM)
        start = time.monotonic()
        for e in self.engines:
            if e.proc is None:
                continue
            try:
                e.proc.wait(max(0.1, start + ENGINE_STOP_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(e, signal.SIGKILL)  # a leader still waiting, or a straggler whose leader is gone
            e.proc.wait()
            e.log.close()
        for child in self.children:
            child.wait(max(0.1, start + STOP_S - time.monotonic()))


def _signal_group(engine, sig: int) -> None:
    if engine.proc is None:
        return
    try:
        os.killpg(engine.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":  # python -m sglang_adapter.demo build-model DIR SEED
    if len(sys.argv) != 4 or sys.argv[1] != "build-model":
        sys.exit("usage: python -m sglang_adapter.demo build-model DIR SEED")
    build_demo_model(Path(sys.argv[2]), seed=int(sys.argv[3]))
