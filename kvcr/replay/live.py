"""`kvcr replay --live`: the trace through the real stack (`kvcr router`, or Dynamo's frontend with
`--live-router dynamo`, and `kvcr worker`s on this machine), next to what the simulation predicts
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


@dataclass(frozen=True, slots=True)
class LiveOutcome:
    blocks: int
    dram: int
    nvme: int
    peer: int
    latency_s: float
    error: str | None = None


def page_tokens(block: int, page_size: int) -> list[int]:
    rng = random.Random(block)
    return [rng.randrange(VOCAB) for _ in range(page_size)]



class LiveCluster:
    """N `kvcr worker`s (no NVMe: DRAM only, as the matching simulation) behind `kvcr router`, or
    behind Dynamo's unmodified frontend and KV router (`router="dynamo"`, workers run `--dynamo`)."""

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

    def send(self, tokens: list[int], rid: str) -> tuple[int, dict | bytes]:
        """One request (one token generated) through the router: (HTTP status, the worker's `kvcr`
        record of what serving it took, or the error body)."""
        if self.kind == "kvcr":
            body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}, "rid": rid}
            status, _, raw = http(self.router.url + "/generate", body, timeout_s=120)
            return (status, json.loads(raw)["meta_info"]["kvcr"]) if status == 200 else (status, raw)
        # Dynamo's responses carry no kvcr fields: the worker that served it keeps them by Dynamo's id.
        status, _, raw = http(self.frontend.url + "/v1/completions", {
            "model": self.model, "prompt": tokens, "max_tokens": 1, "ignore_eos": True}, timeout_s=120)
        if status != 200:
            return status, raw
        from kvcr.dynamo.local import served_record

        response_id = json.loads(raw)["id"]
        found = served_record({w.name: w.url for w in self.workers}, response_id)
        return (200, found[1]) if found else (500, f"no worker served Dynamo's request {response_id}".encode())

    @property
    def slots_per_worker(self) -> int:
        return min(pool["num_slots"] for w in self.workers for pool in w.info["kvcr_runner"]["pools"])

    def stop(self) -> None:
        stop_all([*([self.router] if self.router else []), *self.workers])
        if self.frontend is not None:
            self.frontend.stop()


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
        tokens = [t for b in req.blocks for t in page_tokens(b, page_size)]
        start = time.monotonic()
        status, kv = cluster.send(tokens, f"replay-{i}")
        latency = time.monotonic() - start
        if status != 200:
            result = LiveOutcome(len(req.blocks), 0, 0, 0, latency, f"HTTP {status}: {kv[:200]!r}")
        else:
            result = LiveOutcome(len(req.blocks), kv["dram_pages"], kv["nvme_pages"], kv["peer_pages"], latency)
        with lock:
            out[i] = result
        progress(1)

    with ThreadPoolExecutor(concurrency, thread_name_prefix="kvcr-replay-live") as pool:
        for future in [pool.submit(send, i, r) for i, r in enumerate(trace)]:
            future.result()
    return [o for o in out if o is not None]


def summarise(outcomes: Sequence[LiveOutcome]) -> dict:
    blocks = sum(o.blocks for o in outcomes) or 1
    latencies = sorted(o.latency_s for o in outcomes)
    return {"requests": len(outcomes), "errors": sum(o.error is not None for o in outcomes),
            "reuse": sum(o.dram + o.nvme + o.peer for o in outcomes) / blocks,
            "reuse_by_tier": {"dram": sum(o.dram for o in outcomes) / blocks, "nvme": sum(o.nvme for o in outcomes) / blocks,
                              "peer": sum(o.peer for o in outcomes) / blocks},
            "latency_p50_s": latencies[len(latencies) // 2] if latencies else 0.0,
            "latency_mean_s": statistics.fmean(latencies) if latencies else 0.0}


def compare(trace: Sequence[TraceRequest], cfg: SimConfig, *, page_size: int, run_dir: Path | None = None,
            router: str = "kvcr", progress: Callable[[int], None] = lambda n: None) -> dict:
    """The trace through a live cluster shaped as `cfg` (its workers, DRAM of cfg.dram_blocks pages,
    no NVMe, its speed-up), and the kvcr simulation of that same cluster."""
    page_bytes = 2 * 2 * page_size * 64 * 4  # the live workers' model: 2 layers, hidden 64, float32
    live, slots = run_live(trace, workers=cfg.workers, page_size=page_size, dram=str(cfg.dram_blocks * page_bytes),
                           speedup=cfg.speedup, run_dir=run_dir, router=router, progress=progress)
    same = replace(cfg, dram_blocks=slots, nvme_blocks=0, block_tokens=page_size)
    full_blocks = [replace(r, input_length=len(r.blocks) * page_size) for r in trace]
    predicted = simulate(full_blocks, same, ["kvcr"])["kvcr"].summary(same.block_bytes)
    return {"requests": len(trace), "router": router, "pages_per_worker": slots, "measured": live,
            "simulated": {k: predicted[k] for k in ("reuse", "reuse_by_tier", "pulled_blocks")},
            "reuse_live_over_simulated": live["reuse"] / predicted["reuse"] if predicted["reuse"] else None}


def run_live(trace: Sequence[TraceRequest], *, workers: int, page_size: int, dram: str, speedup: float,
             run_dir: Path | None = None, router: str = "kvcr",
             progress: Callable[[int], None] = lambda n: None) -> tuple[dict, int]:
    """(live summary, DRAM pages per worker): the cluster is started and stopped here."""
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="kvcr-replay-live-"))
    cluster = LiveCluster(workers, page_size=page_size, dram=dram, run_dir=run_dir, router=router)
    try:
        cluster.start()
        outcomes = drive(cluster, trace, page_size=page_size, speedup=speedup, progress=progress)
        return summarise(outcomes), cluster.slots_per_worker
    finally:
        cluster.stop()
