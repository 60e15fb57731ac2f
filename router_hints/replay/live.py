"""`kvcr replay --live`: the trace through the real stack (`kvcr router`, or Dynamo's frontend with
`--live-router dynamo`, and `kvcr worker`s on this machine, or live SGLang engines with kvcr's
backend behind `kvcr router` with `--live-engine sglang`), next to what the simulation predicts
for the same workers.

Block-size scaling: each trace block becomes one KV page of `--page-size` tokens (ids drawn from
the block id, so equal ids give equal pages); a request is its full blocks. Time compression:
arrivals are replayed `--speedup` times faster, each request sent at its own time.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from kvcr.demo.httpc import http
from kvcr.demo.procs import Child, stop_all, worker_command
from kvcr.drivers.ucx_env import SINGLE_HOST_UCX_ENV

from .sim import SimConfig, simulate
from .trace import TraceRequest

VOCAB = 2048  # the worker's default model
INSTANT_PREFILL = 1e15  # tokens/s: a simulated worker that is never seen busy
SGLANG_VOCAB = 512  # the CPU harness's tiny model


@dataclass(frozen=True, slots=True)
class LiveOutcome:
    blocks: int
    dram: int
    nvme: int
    peer: int
    latency_s: float
    error: str | None = None
    worker: str | None = None  # the worker that served it (the router's X-KVCR-Worker, or Dynamo's pick)


def page_tokens(block: int, page_size: int, vocab: int = VOCAB) -> list[int]:
    rng = random.Random(block)
    return [rng.randrange(vocab) for _ in range(page_size)]



class LiveCluster:
    """N `kvcr worker`s (no NVMe: DRAM only, as the matching simulation) behind `kvcr router`, or
    behind Dynamo's unmodified frontend and KV router (`router="dynamo"`, workers run `--dynamo`)."""

    vocab = VOCAB

    def __init__(self, workers: int, *, page_size: int, dram: str, run_dir: Path, router: str = "kvcr") -> None:
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.kind = router
        env = {**SINGLE_HOST_UCX_ENV, **os.environ}
        if router == "dynamo":
            from kvcr.dynamo.local import dynamo_env, file_discovery

            env = dynamo_env(file_discovery(run_dir / "discovery"), env)
        extra = ["--dynamo"] if router == "dynamo" else []
        self.workers = [Child(self.logs, f"w{i}", [*worker_command(
            f"w{i}", run_dir / f"w{i}", page_size=page_size, layers=2, hidden=64, seed=0, dram=dram,
            transport="get", nvme=False), *extra], env) for i in range(workers)]
        self.router: Child | None = None
        self.frontend = None
        self.env = env
        self.page_size = page_size

    @staticmethod
    def page_bytes(page_size: int) -> int:
        return 2 * 2 * page_size * 64 * 4  # the workers' model: 2 layers, hidden 64, float32, K and V

    def pulled_pages(self) -> int | None:
        """Pulled pages over the run, where requests cannot tell (None: each request's record does)."""
        return None

    def start(self) -> "LiveCluster":
        if self.kind == "dynamo":
            from kvcr.dynamo.local import Frontend

            self.frontend = Frontend(self.logs, self.env, block_size=self.page_size).start()
        for w in self.workers:
            w.start()
        for w in self.workers:
            w.wait_ready()
        if self.kind == "dynamo":
            self._await_dynamo()
            return self
        cfg = {"router": {"port": 0, "block_size": self.page_size},
               "workers": [{"name": w.name, "url": w.url} for w in self.workers]}
        (self.run_dir / "router.json").write_text(json.dumps(cfg))
        self.router = Child(self.logs, "router", ["router", "--config", str(self.run_dir / "router.json")], self.env)
        self.router.start()
        self.router.wait_ready()
        return self

    def _await_dynamo(self) -> None:
        from kvcr.dynamo.local import await_registration, poll

        for w in self.workers:
            await_registration(w)
        self.model = self.workers[0].info["model"]
        poll(lambda: self.model in self.frontend.models(), 60, "the model served by Dynamo")

    def send(self, tokens: list[int], rid: str) -> tuple[int, dict | bytes, str | None]:
        """One request (one token generated) through the router: (HTTP status, the worker's `kvcr`
        record of what serving it took or the error body, the worker that served it)."""
        if self.kind == "kvcr":
            body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}, "rid": rid}
            status, headers, raw = http(self.router.url + "/generate", body, timeout_s=120)
            if status != 200:
                return status, raw, None
            return status, json.loads(raw)["meta_info"]["kvcr"], headers.get("X-KVCR-Worker")
        # Dynamo's responses carry no kvcr fields: the worker that served it keeps them by Dynamo's id.
        status, _, raw = http(self.frontend.url + "/v1/completions", {
            "model": self.model, "prompt": tokens, "max_tokens": 1, "ignore_eos": True}, timeout_s=120)
        if status != 200:
            return status, raw, None
        from kvcr.dynamo.local import served_record

        response_id = json.loads(raw)["id"]
        found = served_record({w.name: w.url for w in self.workers}, response_id)
        if found is None:
            return 500, f"no worker served Dynamo's request {response_id}".encode(), None
        return 200, found[1], found[0]

    @property
    def slots_per_worker(self) -> int:
        return min(pool["num_slots"] for w in self.workers for pool in w.info["kvcr_runner"]["pools"])

    def stop(self) -> None:
        stop_all([*([self.router] if self.router else []), *self.workers])
        if self.frontend is not None:
            self.frontend.stop()


class SGLangCluster:
    """N live SGLang engines (the CPU harness's tiny Llama, `--hicache-storage-backend kvcr`, a
    runner of `dram` bytes each, no NVMe) behind `kvcr router`. Each engine's own device and host
    pools are kept below its runner's, so the runner's LRU is what the simulation models."""

    vocab = SGLANG_VOCAB

    def __init__(self, workers: int, *, page_size: int, dram: str, run_dir: Path, longest_tokens: int) -> None:
        from sglang_adapter.demo import require_sglang

        require_sglang()
        self.run_dir, self.page_size = run_dir, page_size
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.model_dir = run_dir / "model"
        self.device_tokens = max(1024, -(-(longest_tokens + 8 * page_size) // page_size) * page_size)
        self.dram, self.workers_n = dram, workers
        self.engines: list = []
        self.router: Child | None = None
        self._pulled_before = 0.0

    @staticmethod
    def page_bytes(page_size: int) -> int:
        return 2 * 2 * 2 * 16 * 2 * page_size  # the tiny model: 2 layers x K, V x 2 KV heads x 16 dims x bf16

    def start(self) -> "SGLangCluster":
        from sglang_adapter.demo import build_model_apart, router_config
        from sglang_adapter.cpu_harness.server import LiveServer

        build_model_apart(self.model_dir, 0)
        for key, value in SINGLE_HOST_UCX_ENV.items():  # the engines inherit this environment
            os.environ.setdefault(key, value)
        flags = ["--page-size", str(self.page_size), "--max-total-tokens", str(self.device_tokens),
                 "--hicache-write-policy", "write_through", "--hicache-storage-prefetch-policy", "wait_complete"]
        for i in range(self.workers_n):
            runner = {"runner.state_dir": str(self.run_dir / f"w{i}"), "dram.size": self.dram, "runner.transfer": "get"}
            self.engines.append(LiveServer(self.logs, f"w{i}", self.model_dir, runner=runner, args=flags,
                                           extra_config={"prefetch_threshold": self.page_size}))
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_ready()
        (self.run_dir / "router.json").write_text(json.dumps(router_config(self.engines, self.page_size, self.model_dir)))
        self.router = Child(self.logs, "router", ["router", "--config", str(self.run_dir / "router.json")],
                            dict(os.environ))
        self.router.start()
        self.router.wait_ready()
        self._pulled_before = self._pulled()
        return self

    def send(self, tokens: list[int], rid: str) -> tuple[int, dict | bytes, str | None]:
        # SGLang computes at least a prompt's last token, so a page-aligned prompt could never reuse
        # its last page: one extra token (not a page of the trace) lets every block be reused
        body = {"input_ids": [*tokens, 2], "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}, "rid": rid}
        status, headers, raw = http(self.router.url + "/generate", body, timeout_s=120)
        if status != 200:
            return status, raw, None
        cached = json.loads(raw)["meta_info"]["cached_tokens"] // self.page_size
        # engine pools and local kvcr pages alike; pulled pages are split out over the whole run
        return status, {"dram_pages": cached, "nvme_pages": 0, "peer_pages": 0}, headers.get("X-KVCR-Worker")

    def _pulled(self) -> float:
        from kvcr.demo.sglang_driver import metric

        return sum(metric(e.runner_get("/metrics"), "kvcr_pulled_pages_total") for e in self.engines)

    def pulled_pages(self) -> int | None:
        return int(self._pulled() - self._pulled_before)

    @property
    def slots_per_worker(self) -> int:
        return min(pool["num_slots"] for e in self.engines for pool in e.runner_get("/info")["pools"])

    def stop(self) -> None:
        stop_all([self.router] if self.router else [])
        for e in self.engines:
            e.stop()


def drive(cluster: LiveCluster, trace: Sequence[TraceRequest], *, page_size: int, speedup: float,
          concurrency: int = 8, progress: Callable[[int], None] = lambda n: None) -> list[LiveOutcome]:
    """Send each request at its (compressed) arrival time; outcomes in trace order."""
    t0 = time.monotonic()
    first = trace[0].arrival_s if trace else 0.0
    out: list[LiveOutcome | None] = [None] * len(trace)
    lock = threading.Lock()

    def send(i: int, req: TraceRequest) -> None:
        delay = (req.arrival_s - first) / speedup - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        tokens = [t for b in req.blocks for t in page_tokens(b, page_size, cluster.vocab)]
        start = time.monotonic()
        status, kv, worker = cluster.send(tokens, f"replay-{i}")
        latency = time.monotonic() - start
        if status != 200:
            result = LiveOutcome(len(req.blocks), 0, 0, 0, latency, f"HTTP {status}: {kv[:200]!r}")
        else:
            result = LiveOutcome(len(req.blocks), kv["dram_pages"], kv["nvme_pages"], kv["peer_pages"], latency,
                                 worker=worker)
        with lock:
            out[i] = result
        progress(1)

    with ThreadPoolExecutor(concurrency, thread_name_prefix="kvcr-replay-live") as pool:
        for future in [pool.submit(send, i, r) for i, r in enumerate(trace)]:
            future.result()
    return [o for o in out if o is not None]


def summarise(outcomes: Sequence[LiveOutcome], *, pulled: int | None = None) -> dict:
    """Reuse by tier and latency. `pulled`: the run's pulled pages, where a request's record could
    not tell them from local ones (SGLang reports only how many tokens it found cached); they
    move from the local share to the peer share."""
    blocks = sum(o.blocks for o in outcomes) or 1
    latencies = sorted(o.latency_s for o in outcomes)
    dram, peer = sum(o.dram for o in outcomes), sum(o.peer for o in outcomes)
    if pulled is not None:
        dram, peer = max(0, dram - pulled), peer + min(pulled, dram)
    nvme = sum(o.nvme for o in outcomes)
    served: dict[str, int] = {}
    for o in outcomes:
        if o.worker is not None:
            served[o.worker] = served.get(o.worker, 0) + 1
    return {"requests": len(outcomes), "errors": sum(o.error is not None for o in outcomes),
            "requests_by_worker": dict(sorted(served.items())),
            "reuse": (dram + nvme + peer) / blocks,
            "reuse_by_tier": {"dram": dram / blocks, "nvme": nvme / blocks, "peer": peer / blocks},
            "latency_p50_s": latencies[len(latencies) // 2] if latencies else 0.0,
            "latency_mean_s": statistics.fmean(latencies) if latencies else 0.0}


def compare(trace: Sequence[TraceRequest], cfg: SimConfig, *, page_size: int, run_dir: Path | None = None,
            router: str = "kvcr", engine: str = "kvcr", concurrency: int = 8,
            progress: Callable[[int], None] = lambda n: None) -> dict:
    """The trace through a live cluster shaped as `cfg` (its workers, DRAM of cfg.dram_blocks pages,
    no NVMe, its speed-up), at most `concurrency` requests in flight, and the kvcr simulation of
    that same cluster (`simulated_cluster`)."""
    page_bytes = (SGLangCluster if engine == "sglang" else LiveCluster).page_bytes(page_size)
    live, slots = run_live(trace, workers=cfg.workers, page_size=page_size, dram=str(cfg.dram_blocks * page_bytes),
                           speedup=cfg.speedup, run_dir=run_dir, router=router, engine=engine,
                           concurrency=concurrency, progress=progress)
    same = simulated_cluster(cfg, slots=slots, page_size=page_size, concurrency=concurrency)
    full_blocks = [replace(r, input_length=len(r.blocks) * page_size) for r in trace]
    predicted = simulate(full_blocks, same, ["kvcr"])["kvcr"].summary(same.block_bytes)
    return {"requests": len(trace), "router": router, "engine": engine, "concurrency": concurrency,
            "pages_per_worker": slots, "measured": live,
            "simulated": {k: predicted[k] for k in ("reuse", "reuse_by_tier", "pulled_blocks", "requests_by_worker")},
            "reuse_live_over_simulated": live["reuse"] / predicted["reuse"] if predicted["reuse"] else None}


def simulated_cluster(cfg: SimConfig, *, slots: int, page_size: int, concurrency: int) -> SimConfig:
    """The simulation of a live cluster: its DRAM pages, no NVMe, one trace block per page. With one
    request in flight each is served before the next is sent, so the live router never sees a busy
    worker: its simulated workers prefill instantly, leaving the choice to overlap alone."""
    same = replace(cfg, dram_blocks=slots, nvme_blocks=0, block_tokens=page_size)
    return replace(same, prefill_tokens_per_s=INSTANT_PREFILL) if concurrency == 1 else same


def check_options(*, router: str, engine: str, concurrency: int) -> None:
    """Refuse, by name, a live run that cannot be made (ValueError)."""
    if concurrency < 1:
        raise ValueError(f"--live-concurrency {concurrency} must be at least 1")
    if engine == "sglang" and router != "kvcr":
        raise ValueError("--live-engine sglang runs behind kvcr router only (not --live-router dynamo)")


def run_live(trace: Sequence[TraceRequest], *, workers: int, page_size: int, dram: str, speedup: float,
             run_dir: Path | None = None, router: str = "kvcr", engine: str = "kvcr", concurrency: int = 8,
             progress: Callable[[int], None] = lambda n: None) -> tuple[dict, int]:
    """(live summary, DRAM pages per worker): the cluster is started and stopped here."""
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="kvcr-replay-live-"))
    check_options(router=router, engine=engine, concurrency=concurrency)
    if engine == "sglang":
        cluster = SGLangCluster(workers, page_size=page_size, dram=dram, run_dir=run_dir,
                                longest_tokens=max((len(r.blocks) for r in trace), default=1) * page_size)
    else:
        cluster = LiveCluster(workers, page_size=page_size, dram=dram, run_dir=run_dir, router=router)
    try:
        cluster.start()
        outcomes = drive(cluster, trace, page_size=page_size, speedup=speedup, concurrency=concurrency,
                         progress=progress)
        return summarise(outcomes, pulled=cluster.pulled_pages()), cluster.slots_per_worker
    finally:
        cluster.stop()
