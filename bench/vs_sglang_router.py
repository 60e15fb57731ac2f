"""kvcr beside the router SGLang operators run, on SGLang's own benchmark client, same engines, same run.

    .venv/bin/python bench/vs_sglang_router.py [--workloads exceeds fits mooncake] [--scenarios knee restart]
        [--repeats 2] [--quick] [--no-write]

Two live SGLang 0.5.23 engines (the development-only CPU harness) take SGLang's own client
(`python -m sglang.benchmark.serving`, `--cache-report --output-details`) through each router in
front of them, on three workloads: `generated-shared-prefix` that fits the engines' pools and that
exceeds them, and a multi-turn trace in Mooncake's format the bench writes (seeded) and the client
replays at its timestamps (`--dataset-name mooncake`; a subset of the rows, see ROWS):

- `kvcr router` on kvcr engines (the launcher's defaults: the engines' own events relayed, and
  each engine finds the other in the user's peers directory);
- sglang-router 0.3.2 (its own environment, `.venv-sglang-router`) with `cache_aware` at its
  default thresholds and with `--balance-abs-threshold` tuned to the load, and `round_robin`;
- `round_robin` on kvcr engines with discovery off (`peers_dir: ""`): what the defaults add;
- `round_robin` and `cache_aware` on SGLang's stock `file` backend, both engines in one directory
  (what an operator has without kvcr).

Runs on one set of engines alternate A B … B A; before each run every engine's device and host
pools are flushed and its L3 storage cleared (kvcr's runner; the `file` directory emptied).
The anchor is the better (lower mean TTFT) of the two
`cache_aware` rows; "vs anchor" is the median over prompts of a row's TTFT over the anchor's for
the same prompt (same seed, same request order), in the same repeat.

Before the workloads, on one set of kvcr engines (`--scenarios`):

- knee: one engine alone (its own URL, no router) takes the exceeds prompts sent at once at max
  concurrency 1, 2, 4, 8, 16; the knee is the smallest whose throughput (completed requests over
  the client's duration) is within 90 % of the best, and exceeds then runs at twice it, sent at
  once (`--quick` skips it: exceeds at a fixed concurrency);
- restart: behind `kvcr router` and behind sglang-router `cache_aware`, caches emptied, a small
  fits workload once, engine B stopped and started again on the same ports (same URL for the
  routers, same runner endpoints for its peer), the same prompts again; B's own counters say how
  many of its prompt tokens came from its caches, from storage (pulled from A: its runner starts
  empty) or were recomputed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Spread, machine_line, managed_venv, publish, table  # noqa: E402

SGLANG_ROUTER = "sglang-router==0.3.2"
ANCHORS = ("sglang-router cache_aware", "sglang-router cache_aware tuned")


@dataclass(frozen=True)
class Workload:
    name: str
    groups: int
    per_group: int
    system_len: int  # what the client asks for; the tiny tokenizer makes ~1.7x as many tokens
    rate: float
    concurrency: int
    zipf: float = 0.0  # > 0: groups drawn with this skew

    @property
    def total(self) -> int:
        return self.groups * self.per_group

    def client_args(self) -> list[str]:
        skew = ["--gsp-group-distribution", "zipf", "--gsp-zipf-alpha", str(self.zipf)] if self.zipf else []
        return ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(self.groups),
                "--gsp-prompts-per-group", str(self.per_group), "--gsp-system-prompt-len", str(self.system_len),
                "--gsp-question-len", "32", "--gsp-output-len", "8", "--num-prompts",
                str(self.total), "--request-rate", str(self.rate),
                "--max-concurrency", str(self.concurrency), *skew]

    def describe(self) -> str:
        skew = f", zipf {self.zipf}" if self.zipf else ""
        rate = "all sent at once" if math.isinf(self.rate) else f"{self.rate:g} req/s"
        return (f"{self.groups} groups x {self.per_group} prompts{skew}, ~{int(self.system_len * 1.7)}-token shared "
                f"prefixes, {rate}, concurrency {self.concurrency}")


BLOCK = 512  # tokens per Mooncake hash_id


@dataclass(frozen=True)
class Trace:
    """Multi-turn sessions in Mooncake's trace format (a JSON line a request: timestamp in ms,
    input_length, output_length, hash_ids of its 512-token blocks), replayed by SGLang's client at
    the trace's timestamps. Each turn repeats the session's blocks and adds one, and a session opens
    with one of a few shared system-prompt blocks, as Mooncake's conversation trace does."""
    name: str
    requests: int
    sessions_per_s: float         # Poisson session starts
    system_prompts: int = 4
    turns: tuple[int, int] = (2, 5)
    think_s: tuple[float, float] = (2.0, 6.0)  # between a session's turns
    output_len: int = 8
    seed: int = 7
    path: Path = Path("mooncake.jsonl")

    @property
    def total(self) -> int:
        return self.requests

    def records(self) -> list[dict]:
        rng = random.Random(self.seed)
        records, fresh, start = [], self.system_prompts, 0.0
        while len(records) < self.requests:
            start += rng.expovariate(self.sessions_per_s)
            blocks, at = [rng.randrange(self.system_prompts)], start
            for _ in range(rng.randint(*self.turns)):
                blocks, fresh = [*blocks, fresh], fresh + 1
                records.append({"timestamp": round(at * 1000), "output_length": self.output_len, "hash_ids": blocks,
                                "input_length": BLOCK * (len(blocks) - 1) + rng.randint(1, BLOCK)})
                at += rng.uniform(*self.think_s)
        # the latest go: a session keeps its earlier turns; the client's warmup request is the first
        # line at 512 words a block, so a two-block first turn keeps it inside the context
        return sorted(records, key=lambda r: r["timestamp"])[:self.requests]

    def written(self, directory: Path) -> "Trace":
        path = directory / f"{self.name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records()))
        return dataclasses.replace(self, path=path)

    def client_args(self) -> list[str]:
        return ["--dataset-name", "mooncake", "--dataset-path", str(self.path), "--num-prompts", str(self.requests),
                "--mooncake-slowdown-factor", "1", "--mooncake-num-rounds", "1"]

    def describe(self) -> str:
        records = self.records()
        span_s = (records[-1]["timestamp"] - records[0]["timestamp"]) / 1000
        longest = max(len(r["hash_ids"]) for r in records)
        return (f"a Mooncake-format trace (written by the bench, seed {self.seed}): {self.requests} requests in "
                f"multi-turn sessions starting at {self.sessions_per_s:g}/s (Poisson), "
                f"{self.turns[0]}–{self.turns[1]} turns {self.think_s[0]:g}–{self.think_s[1]:g} s apart, each turn "
                f"one {BLOCK}-token block (hash_id) longer than the last, opening with one of "
                f"{self.system_prompts} shared system-prompt blocks; "
                f"{self.requests / span_s:.1f} req/s over {span_s:.0f} s, replayed at the trace's timestamps; "
                f"{longest} blocks at most, which SGLang's Mooncake loader writes as 128 words a block (~257 "
                f"tokens here: it ignores input_length), {self.output_len} output tokens")


# Each engine's device pool holds 4096 tokens (256 pages): "fits" needs ~1.3k prefix pages per
# engine at most; "exceeds" asks for ~1.1k-token prefixes over 24 groups, several times both pools.
WORKLOADS = {"fits": Workload("fits", 8, 8, 300, 2.0, 2),
             "exceeds": Workload("exceeds", 24, 4, 650, 3.0, 4, zipf=1.1),
             "mooncake": Trace("mooncake", 208, 1.6)}
QUICK = {"fits": Workload("fits", 3, 4, 200, 2.0, 2), "exceeds": Workload("exceeds", 6, 3, 400, 3.0, 3, zipf=1.1),
         "mooncake": Trace("mooncake", 40, 1.6)}


@dataclass(frozen=True)
class System:
    name: str
    engines: str             # which engine set: "kvcr", "kvcr-alone", "kvcr-timeout", "file"
    router: str              # "kvcr" or an sglang-router policy
    router_args: tuple[str, ...] = ()


SYSTEMS = (System("kvcr router", "kvcr", "kvcr"),
           System("sglang-router cache_aware", "kvcr", "cache_aware"),
           System("sglang-router cache_aware tuned", "kvcr", "cache_aware", ("--balance-abs-threshold", "2")),
           System("sglang-router round_robin", "kvcr", "round_robin"),
           System("sglang-router round_robin, kvcr peers off", "kvcr-alone", "round_robin"),
           System("sglang-router round_robin, kvcr timeout prefetch", "kvcr-timeout", "round_robin"),
           System("sglang-router cache_aware, kvcr timeout prefetch", "kvcr-timeout", "cache_aware"),
           System("sglang-router round_robin, SGLang file", "file", "round_robin"),
           System("sglang-router cache_aware, SGLang file", "file", "cache_aware"))


@dataclass
class Run:
    ok: int
    total: int
    share: float        # cached prompt tokens / prompt tokens
    device_share: float
    mean_ttft: float    # ms
    p99_ttft: float
    mean_e2e: float
    ttfts: list[float] = field(default_factory=list)  # s, in request order
    stages: dict[str, float] = field(default_factory=dict)  # where the time went: mean per request
    throughput: float = 0.0  # completed requests / s


def wait_for(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.5)


def router_down(url: str) -> float:
    """Workers kvcr's router routes nothing to: down (events stopped) or failing."""
    from kvcr.demo.sglang_driver import metric

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return metric(text, "kvcr_router_workers_down") + metric(text, "kvcr_router_workers_failing")


def wait_http(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


class EngineSet:
    """Two engines of one kind, and the routers in front of them (started once, reused)."""

    def __init__(self, kind: str, run: Path, model: Path, sgr_python: str) -> None:
        from sglang_adapter.cpu_harness.server import LiveServer, free_port

        self.kind, self.run, self.model, self.sgr_python = kind, run, model, sgr_python
        self.file_dir = run / "hicache-file"
        args = ["--enable-cache-report", "--enable-metrics"]  # metrics: where each request's time went
        if kind == "file":
            env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.file_dir)}
            self.engines = [LiveServer(run, f"file-{n}", model, backend="file", env=env, args=args) for n in "AB"]
        else:
            # kvcr's default peers_dir ("auto") under a runtime directory of this run's own
            (run / "runtime").mkdir(mode=0o700, exist_ok=True)
            runtime = {"XDG_RUNTIME_DIR": str(run / "runtime")}
            if kind == "kvcr-timeout":  # admitted when the pull lands or the prefetch budget runs out
                args = [*args, "--hicache-storage-prefetch-policy", "timeout"]
            self.engines = [LiveServer(run, f"{kind}-{n}", model, args=args, env=runtime,
                                       peers_dir="" if kind == "kvcr-alone" else None) for n in "AB"]
        self.free_port = free_port
        self.routers: dict[tuple, tuple[str, Callable[[], object]]] = {}  # -> (url, how to stop it)

    def __enter__(self) -> "EngineSet":
        self.file_dir.mkdir(exist_ok=True)  # HiCacheFile's makedirs races when two engines make it
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_ready(600)
        return self

    def __exit__(self, *exc) -> None:
        for _, stop in self.routers.values():
            stop()
        for e in self.engines:
            e.stop()

    def router_url(self, system: System) -> str:
        key = (system.router, system.router_args)
        if key not in self.routers:
            self.routers[key] = self._kvcr_router() if system.router == "kvcr" else self._sglang_router(system)
        return self.routers[key][0]

    def _kvcr_router(self) -> tuple[str, Callable[[], object]]:
        from kvcr.demo.procs import Child

        config = self.run / f"router-{self.kind}.json"
        config.write_text(json.dumps({"router": {"port": 0, "block_size": 16, "tokenizer": str(self.model)},
                                      "workers": [{"name": e.name, "url": e.url, "runner": e.endpoints["control"],
                                                   "engine": "sglang"} for e in self.engines]}))
        child = Child(self.run, f"kvcr-router-{self.kind}", ["router", "--config", str(config)]).start()
        child.wait_ready(120)
        return child.url, child.stop

    def _sglang_router(self, system: System) -> tuple[str, Callable[[], object]]:
        port = self.free_port()
        log = open(self.run / f"sglang-router-{self.kind}-{port}.log", "w")
        proc = subprocess.Popen([self.sgr_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                 "--port", str(port), "--prometheus-port", str(self.free_port()),  # one per router
                                 "--policy", system.router, *system.router_args,
                                 "--worker-urls", *[e.url for e in self.engines], "--log-level", "warn"],
                                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health")
        except TimeoutError:
            proc.kill()
            raise
        return url, proc.kill

    def counters(self, system: System) -> dict[str, float]:
        """The engines' (and kvcr's) counters the breakdown is computed from, summed over engines."""
        from kvcr.demo.sglang_driver import metric

        texts = [e.get("/metrics") for e in self.engines]
        got = {key: sum(metric(t, name, **labels) for t in texts) for key, (name, labels) in ENGINE_COUNTERS.items()}
        got["pulled_pages"] = (sum(metric(e.runner_get("/metrics"), "kvcr_pulled_pages_total") for e in self.engines)
                               if self.kind != "file" else 0.0)
        if system.router == "kvcr":
            url = self.router_url(system)
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            got["route_s"] = metric(text, "kvcr_router_route_seconds_sum")
        return got

    def restart(self, index: int) -> None:
        """Engine `index` stopped as an operator stops it (SIGTERM) and started again on the same
        ports (the routers keep its URL, its peers its runner's endpoints); back once it follows its
        peers again and kvcr's router counts no worker down."""
        from kvcr.demo.sglang_driver import metric

        engine = self.engines[index]
        engine.stop()
        engine.start().wait_ready(600)
        for peer in (p for p in self.engines if p is not engine):
            held = len(peer.stored_hashes())
            wait_for(lambda: metric(engine.runner_get("/metrics"), "kvcr_peer_feed_blocks",
                                    peer=peer.endpoints["control"]) >= held, f"{engine.name} follows {peer.name} again")
        for (router, _), (url, _) in self.routers.items():
            if router == "kvcr":
                wait_for(lambda: router_down(url) == 0, f"kvcr's router routes to {engine.name} again")

    def cold(self) -> None:
        """Every run starts from empty caches: device and host pools (/flush_cache) and the L3
        storage, which a flush keeps (SGLang's own clear route: kvcr's runner, the shared directory)."""
        for e in self.engines:
            e.flush(60)
            answer = e.post("/hicache/storage-backend/clear", {})
            if "cleared" not in str(answer):
                raise RuntimeError(f"{e.name}: its storage was not cleared: {answer!r}")
        if self.kind == "file":
            for page in self.file_dir.iterdir():
                page.unlink()


# SGLang's own metrics (--enable-metrics): sums and counts of the stages of a request's first token.
ENGINE_COUNTERS = {
    "requests": ("sglang:time_to_first_token_seconds_count", {}),
    "engine_ttft_s": ("sglang:time_to_first_token_seconds_sum", {}),
    "queue_s": ("sglang:queue_time_seconds_sum", {}),  # waiting, a storage prefetch included
    "load_back_tokens": ("sglang:load_back_tokens_total", {}),  # host pages to device (its timer needs CUDA)
    "prefill_s": ("sglang:per_stage_req_latency_seconds_sum", {"stage": "prefill_forward"}),
    "storage_hit_tokens": ("sglang:storage_prefetch_hit_tokens_total", {}),
}


def stages(before: dict[str, float], after: dict[str, float], run: Run) -> dict[str, float]:
    """Mean per request over one run, in ms (tokens and pages as counts)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    n = max(d.pop("requests"), 1.0)
    out = {k: v / n * (1e3 if k.endswith("_s") else 1) for k, v in d.items()}
    out["front_s"] = run.mean_ttft - out["engine_ttft_s"]  # routing and proxying, as the client sees it
    return out


def client(url: str, workload: Workload | Trace, model: Path, out: Path, seed: int) -> Run:
    """SGLang's own client against `url`; the model is named so it needs no readiness probe."""
    from sglang_adapter.cpu_harness.server import harness_env

    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", url,
           "--model", str(model), "--tokenizer", str(model), *workload.client_args(), "--seed", str(seed),
           "--output-file", str(out), "--cache-report", "--output-details", "--disable-tqdm"]
    done = subprocess.run(cmd, cwd=ROOT, env=harness_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"SGLang's client failed against {url}:\n{done.stderr[-3000:]}")
    r = json.loads(out.read_text().splitlines()[-1])
    c = r["cache_report"]
    prompt = c["total_prompt_tokens"] or 1
    return Run(r["completed"], workload.total, c["total_cached_tokens"] / prompt,
               (c["device_cached_tokens"] or 0) / prompt, r["mean_ttft_ms"], r["p99_ttft_ms"],
               r["mean_e2e_latency_ms"], r["ttfts"], throughput=r["completed"] / r["duration"])


def measure(workload: Workload | Trace, repeats: int, run: Path, model: Path, sgr_python: str,
            systems: tuple[System, ...] = SYSTEMS, costs: list[str] | None = None) -> dict[str, list[Run]]:
    """Each system's runs; `costs` gets what kvcr's router measured by the end."""
    costs = [] if costs is None else costs
    got: dict[str, list[Run]] = {s.name: [] for s in systems}
    for kind in dict.fromkeys(s.engines for s in systems):
        of_kind = [s for s in systems if s.engines == kind]
        with EngineSet(kind, run, model, sgr_python) as engines:
            for r in range(repeats):
                order = of_kind if r % 2 == 0 else of_kind[::-1]  # A B ... B A
                for i, system in enumerate(order, 1):
                    print(f"  {workload.name}, {kind} engines, repeat {r + 1}/{repeats}: {system.name} "
                          f"({i}/{len(order)})", flush=True)
                    engines.cold()
                    url, before = engines.router_url(system), engines.counters(system)
                    result = client(url, workload, model, run / "client.jsonl", seed=7)
                    result.stages = stages(before, engines.counters(system), result)
                    got[system.name].append(result)
            if any(s.router == "kvcr" for s in of_kind):
                costs.append(measured_costs(engines))
    return got


def measured_costs(engines: EngineSet) -> str:
    """What kvcr's router measured of each engine over the workload's runs (router_hints/rates.py)."""
    from kvcr.demo.sglang_driver import metric

    with urllib.request.urlopen(engines.router_url(SYSTEMS[0]) + "/metrics", timeout=10) as r:
        text = r.read().decode()
    parts = []
    for e in engines.engines:
        samples = metric(text, "kvcr_router_cost_samples_total", worker=e.name)
        per = {k: metric(text, "kvcr_router_seconds_per_block", worker=e.name, kind=k) * 1e3
               for k in ("computed", "device", "host", "dram", "pulled")}
        sources = {t: "measured" if f'source="measured",tier="{t}",worker="{e.name}"' in text else "configured"
                   for t in ("device", "host", "dram", "pulled")}
        weights = ", ".join(f"{t} {metric(text, 'kvcr_router_tier_weight', worker=e.name, tier=t):.2f} ({src})"
                            for t, src in sources.items())
        fit = ", ".join(f"{k} {v:.2f}" for k, v in per.items()) if samples >= 64 else "not fitted yet"
        parts.append(f"{e.name}: {samples:.0f} streamed requests timed; ms per block: {fit}; weights: {weights}")
    return "kvcr router's measured costs at the end (`/metrics`): " + "; ".join(parts) + "."


# 16 beside 1-8, so a knee of 8 is one the curve shows rather than the end of the range: two of
# three first runs here (another load on the two cores) still rose at 8.
KNEE_CONCURRENCY = (1, 2, 4, 8, 16)
# The exceeds prompts sent at once, the client's concurrency the only limit: one engine alone
# completed 5-20 requests/s at concurrency 1 in those runs, so at the former 3 req/s over two
# engines each had well under one request in flight and no concurrency limit ever bound.
EXCEEDS_RATE = math.inf


@dataclass(frozen=True)
class Knee:
    """One kvcr engine's throughput (no router) on the exceeds prompts sent at once, per max concurrency."""
    prompts: int
    throughputs: dict[int, float]  # max concurrency -> completed requests / s

    @property
    def knee(self) -> int:
        best = max(self.throughputs.values())
        return min(c for c, t in self.throughputs.items() if t >= 0.9 * best)

    def lines(self) -> list[str]:
        measured = ", ".join(f"{t:.1f} at {c}" for c, t in self.throughputs.items())
        return [f"Knee of one engine, measured in this run (a kvcr engine on its own URL, no router; SGLang's "
                f"client with the {self.prompts} exceeds prompts sent at once, caches emptied before each "
                f"concurrency): requests/s {measured}; the knee (the smallest concurrency within 90 % of the "
                f"best) is {self.knee}, so exceeds runs at concurrency {2 * self.knee}."]


def measure_knee(engines: EngineSet, workload: Workload, model: Path, run: Path) -> Knee:
    probe = dataclasses.replace(workload, rate=math.inf)
    got = {}
    for concurrency in KNEE_CONCURRENCY:
        engines.cold()
        got[concurrency] = client(engines.engines[0].url, dataclasses.replace(probe, concurrency=concurrency), model,
                                  run / "knee.jsonl", seed=7).throughput
        print(f"  knee: concurrency {concurrency}: {got[concurrency]:.2f} requests/s", flush=True)
    return Knee(probe.total, got)


RESTART_ROWS = ("kvcr router", "sglang-router cache_aware")
# by --quick; sent at once so the routers see load and the restarted engine is sent requests (at
# concurrency 2 kvcr's router sent every one to the engine holding the prefixes)
RESTART = {False: Workload("fits", 8, 4, 300, math.inf, 8), True: Workload("fits", 4, 4, 200, math.inf, 8)}
# Rows the trace runs through (each run is as long as the trace)
ROWS = {"mooncake": ("kvcr router", *ANCHORS, "sglang-router round_robin", "sglang-router round_robin, SGLang file",
                     "sglang-router cache_aware, SGLang file")}
# the restarted engine's own counters (it starts from zero), and its runner's pulls
RESTART_COUNTERS = {
    "requests": ("sglang:num_requests_total", {}),
    "prompt": ("sglang:prompt_tokens_total", {}),
    "device": ("sglang:cached_tokens_total", {"cache_source": "device"}),
    "host": ("sglang:cached_tokens_total", {"cache_source": "host"}),
    "storage": ("sglang:cached_tokens_total", {"cache_source": "storage"}),
    "ttft_s": ("sglang:time_to_first_token_seconds_sum", {}),
    "ttft_count": ("sglang:time_to_first_token_seconds_count", {}),
}


@dataclass(frozen=True)
class Restart:
    """The second run after engine B's restart, as B saw it (prompt tokens by where they came from)."""
    router: str
    counts: dict[str, float]  # RESTART_COUNTERS' keys and "pulled_pages", second run only
    recomputed_a: float  # prompt tokens the peer recomputed meanwhile
    first_ttft: float   # the client's mean, ms: before the restart
    second_ttft: float  # and after

    def row(self) -> str:
        c = self.counts
        engine_ttft = c["ttft_s"] / max(c["ttft_count"], 1) * 1e3
        return (f"| {self.router} | {c['requests']:.0f} | {c['prompt']:.0f} | "
                f"{portion(c['device'] + c['host'], c['prompt'])} | {portion(c['storage'], c['prompt'])} | "
                f"{c['pulled_pages']:.0f} | {portion(recomputed(c), c['prompt'])} | {self.recomputed_a:.0f} | "
                f"{engine_ttft:.0f} | "
                f"{self.first_ttft:.0f} → {self.second_ttft:.0f} |")


def recomputed(counts: dict[str, float]) -> float:
    return counts["prompt"] - counts["device"] - counts["host"] - counts["storage"]


def portion(tokens: float, total: float) -> str:
    return f"{tokens:.0f} ({tokens / max(total, 1):.0%})"


def own_counters(engines: EngineSet, index: int) -> dict[str, float]:
    from kvcr.demo.sglang_driver import metric

    engine = engines.engines[index]
    text = engine.get("/metrics")
    got = {key: metric(text, name, **labels) for key, (name, labels) in RESTART_COUNTERS.items()}
    got["pulled_pages"] = metric(engine.runner_get("/metrics"), "kvcr_pulled_pages_total")
    return got


def measure_restart(engines: EngineSet, workload: Workload, model: Path, run: Path) -> list[Restart]:
    """Per router: cold caches, the workload once, engine B restarted, the same prompts again."""
    got = []
    for system in (s for s in SYSTEMS if s.name in RESTART_ROWS):
        print(f"  restart, {system.name}", flush=True)
        url = engines.router_url(system)
        engines.cold()
        first = client(url, workload, model, run / "client.jsonl", seed=7)
        engines.restart(1)
        before = [own_counters(engines, i) for i in (0, 1)]
        second = client(url, workload, model, run / "client.jsonl", seed=7)
        a, b = ({k: v - was[k] for k, v in own_counters(engines, i).items()} for i, was in enumerate(before))
        got.append(Restart(system.name, b, recomputed(a), first.mean_ttft, second.mean_ttft))
    return got


def restart_report(workload: Workload, got: list[Restart]) -> list[str]:
    columns = ["router (kvcr engines)", "requests to B", "B's prompt tokens", "cached on B (device, host)",
               "from storage: pulled from A", "pages B pulled", "recomputed on B", "recomputed on A",
               "B's engine TTFT ms", "client mean TTFT ms, before → after"]
    return [f"**An engine restarted mid-run**: {workload.describe()}; caches emptied, the prompts run once, engine "
            "B stopped (SIGTERM) and started again on the same ports, then the same prompts again. What B did with "
            "the second run, from its own counters (SGLang's `--enable-metrics`, its runner's pulls; tokens):", "",
            *table(columns, [r.row() for r in got])]


def paired_ratio(runs: list[Run], anchor: list[Run]) -> Spread | None:
    """Per repeat, the median over prompts of TTFT / the anchor's TTFT for the same prompt."""
    ratios = []
    for mine, base in zip(runs, anchor):
        pairs = [m / b for m, b in zip(mine.ttfts, base.ttfts) if m > 0 and b > 0]
        if pairs:
            ratios.append(statistics.median(pairs))
    return Spread.of(ratios) if ratios else None


def report(workload: Workload | Trace, got: dict[str, list[Run]]) -> tuple[list[str], str]:
    anchor = min((a for a in ANCHORS if a in got), key=lambda name: statistics.median(r.mean_ttft for r in got[name]))
    rows = []
    for system in (s for s in SYSTEMS if s.name in got):
        runs = got[system.name]
        ratio = paired_ratio(runs, got[anchor])
        rows.append(f"| {system.name}{' (anchor)' if system.name == anchor else ''} | "
                    f"{min(r.ok for r in runs)}/{runs[0].total} | {Spread.of([r.share for r in runs]).fmt(1, 3)} | "
                    f"{Spread.of([r.device_share for r in runs]).fmt(1, 3)} | "
                    f"{Spread.of([r.mean_ttft for r in runs]).fmt(1, 0)} | "
                    f"{Spread.of([r.p99_ttft for r in runs]).fmt(1, 0)} | "
                    f"{Spread.of([r.mean_e2e for r in runs]).fmt(1, 0)} | {ratio.fmt() if ratio else '-'} |")
    columns = ["router and engines", "ok", "cached share", "from device", "mean TTFT ms", "p99 TTFT ms",
               "mean e2e ms", "TTFT / anchor's, per prompt"]
    return [f"**{workload.name}**: {workload.describe()}.", "", *table(columns, rows), "",
            *breakdown(workload, got)], anchor


BREAKDOWN = (("front_s", "in front of the engine", 1), ("route_s", "of which kvcr's routing", 2),
             ("engine_ttft_s", "engine TTFT", 1), ("queue_s", "queued (prefetch wait included)", 1),
             ("prefill_s", "prefill forward", 1), ("load_back_tokens", "tokens loaded host→device", 0),
             ("storage_hit_tokens", "storage-hit tokens", 0), ("pulled_pages", "pages pulled from the peer", 1))


def breakdown(workload: Workload | Trace, got: dict[str, list[Run]]) -> list[str]:
    """Where a request's time went before its first token: mean per request, median over repeats."""
    rows = []
    for system in (s for s in SYSTEMS if s.name in got):
        runs = got[system.name]
        cells = [Spread.of([r.stages.get(key, 0.0) for r in runs]).fmt(1, digits) if key in runs[0].stages else "-"
                 for key, _, digits in BREAKDOWN]
        rows.append(f"| {system.name} | " + " | ".join(cells) + " |")
    return [f"Where the time went ({workload.name}; mean per request, ms unless a count; from SGLang's own "
            "`--enable-metrics` counters, kvcr's router and runners; the engine's TTFT runs from its tokenizer "
            "to the first token):", "", *table(["router and engines", *(label for _, label, _ in BREAKDOWN)], rows)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="*", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    parser.add_argument("--scenarios", nargs="*", choices=("knee", "restart"),
                        help="run before the workloads: the knee of one engine (exceeds then runs at twice it) "
                        "and an engine restarted mid-run; default both, --quick only restart (exceeds at a fixed "
                        "concurrency)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="+", metavar="SYSTEM", help="only these rows (names as in the table; an "
                        "anchor is always run); nothing is written")
    parser.add_argument("--quick", action="store_true", help="small workloads, 1 repeat, nothing written")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    workloads = dict(QUICK if args.quick else WORKLOADS)
    repeats = 1 if args.quick else args.repeats
    scenarios = args.scenarios if args.scenarios is not None else (("restart",) if args.quick else ("knee", "restart"))
    systems = SYSTEMS if not args.only else tuple(s for s in SYSTEMS if s.name in {*args.only, ANCHORS[0]})
    from sglang_adapter.cpu_harness.model import build_model
    from sglang_adapter.torchvision_stub import install

    install()
    sgr_python = managed_venv(ROOT / ".venv-sglang-router", [[SGLANG_ROUTER]], SGLANG_ROUTER)
    tables, chart, ahead, restarts = [], {}, {}, []
    with tempfile.TemporaryDirectory(prefix="kvcr-bench-vs-sgr-") as tmp:
        run = Path(tmp)
        model = build_model(run / "model")
        workloads["mooncake"] = workloads["mooncake"].written(run)
        if scenarios:
            with EngineSet("kvcr", run, model, sgr_python) as engines:
                if "knee" in scenarios:
                    knee = measure_knee(engines, WORKLOADS["exceeds"], model, run)
                    workloads["exceeds"] = dataclasses.replace(workloads["exceeds"], concurrency=2 * knee.knee,
                                                               rate=EXCEEDS_RATE)
                    ahead["exceeds"] = [*knee.lines(), ""]
                    print("\n".join(knee.lines()), flush=True)
                if "restart" in scenarios:
                    restarts = restart_report(RESTART[args.quick],
                                              measure_restart(engines, RESTART[args.quick], model, run))
                    print("\n".join(restarts), flush=True)
        for name in args.workloads:
            workload = workloads[name]
            rows = tuple(s for s in systems if s.name in ROWS.get(name, (s.name,)))
            costs: list[str] = []
            got = measure(workload, repeats, run, model, sgr_python, rows, costs)
            lines, _ = report(workload, got)
            lines = [*ahead.get(name, []), *lines, *(["", *costs] if costs else [])]
            print("\n".join(lines), flush=True)
            tables.append(lines)
            chart[name] = {s.name: [r.mean_ttft for r in got[s.name]] for s in rows}
    tables += [restarts] if restarts else []
    intro = (f"Two live SGLang 0.5.23 engines on the CPU harness (tiny Llama, 16-token pages, 4096-token device "
             f"pools), SGLang's own client (`sglang.benchmark.serving`: generated-shared-prefix with 8 output "
             f"tokens, and a Mooncake-format trace), {repeats} repeat(s) alternated A B … B A on each set of "
             f"engines, device, host and L3 caches emptied before every run. Figures: median (min–max) over "
             f"repeats. `vs anchor` pairs each prompt with the anchor's run of the same repeat. {machine_line()}. "
             f"Command: `.venv/bin/python bench/vs_sglang_router.py`.")
    publish("vs-sglang-router", "kvcr beside sglang-router, on SGLang's benchmark client", intro, tables,
            write=not (args.quick or args.no_write or args.only), chart=chart, unit="mean TTFT (ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
