"""kvcr beside the router SGLang operators run, on SGLang's own benchmark client, same engines, same run.

    .venv/bin/python bench/vs_sglang_router.py [--workloads fits exceeds] [--repeats 2] [--quick] [--no-write]

Two live SGLang 0.5.23 engines (the development-only CPU harness) take SGLang's own client
(`python -m sglang.benchmark.serving`, `generated-shared-prefix`, `--cache-report
--output-details`) through each router in front of them:

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
"""

from __future__ import annotations

import argparse
import json
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

    def client_args(self) -> list[str]:
        skew = ["--gsp-group-distribution", "zipf", "--gsp-zipf-alpha", str(self.zipf)] if self.zipf else []
        return ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(self.groups),
                "--gsp-prompts-per-group", str(self.per_group), "--gsp-system-prompt-len", str(self.system_len),
                "--gsp-question-len", "32", "--gsp-output-len", "8", "--num-prompts",
                str(self.groups * self.per_group), "--request-rate", str(self.rate),
                "--max-concurrency", str(self.concurrency), *skew]

    def describe(self) -> str:
        skew = f", zipf {self.zipf}" if self.zipf else ""
        return (f"{self.groups} groups x {self.per_group} prompts{skew}, ~{int(self.system_len * 1.7)}-token shared "
                f"prefixes, {self.rate:g} req/s, concurrency {self.concurrency}")


# Each engine's device pool holds 4096 tokens (256 pages): "fits" needs ~1.3k prefix pages per
# engine at most; "exceeds" asks for ~1.1k-token prefixes over 24 groups, several times both pools.
WORKLOADS = {"fits": Workload("fits", 8, 8, 300, 2.0, 2),
             "exceeds": Workload("exceeds", 24, 4, 650, 3.0, 4, zipf=1.1)}
QUICK = {"fits": Workload("fits", 3, 4, 200, 2.0, 2), "exceeds": Workload("exceeds", 6, 3, 400, 3.0, 3, zipf=1.1)}


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


def client(url: str, workload: Workload, model: Path, out: Path, seed: int) -> Run:
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
    return Run(r["completed"], workload.groups * workload.per_group, c["total_cached_tokens"] / prompt,
               (c["device_cached_tokens"] or 0) / prompt, r["mean_ttft_ms"], r["p99_ttft_ms"],
               r["mean_e2e_latency_ms"], r["ttfts"])


def measure(workload: Workload, repeats: int, run: Path, model: Path, sgr_python: str,
            systems: tuple[System, ...] = SYSTEMS) -> dict[str, list[Run]]:
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
    return got


def paired_ratio(runs: list[Run], anchor: list[Run]) -> Spread | None:
    """Per repeat, the median over prompts of TTFT / the anchor's TTFT for the same prompt."""
    ratios = []
    for mine, base in zip(runs, anchor):
        pairs = [m / b for m, b in zip(mine.ttfts, base.ttfts) if m > 0 and b > 0]
        if pairs:
            ratios.append(statistics.median(pairs))
    return Spread.of(ratios) if ratios else None


def report(workload: Workload, got: dict[str, list[Run]]) -> tuple[list[str], str]:
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


def breakdown(workload: Workload, got: dict[str, list[Run]]) -> list[str]:
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
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="+", metavar="SYSTEM", help="only these rows (names as in the table; an "
                        "anchor is always run); nothing is written")
    parser.add_argument("--quick", action="store_true", help="small workloads, 1 repeat, nothing written")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    workloads = QUICK if args.quick else WORKLOADS
    repeats = 1 if args.quick else args.repeats
    systems = SYSTEMS if not args.only else tuple(s for s in SYSTEMS if s.name in {*args.only, ANCHORS[0]})
    from sglang_adapter.cpu_harness.model import build_model
    from sglang_adapter.torchvision_stub import install

    install()
    sgr_python = managed_venv(ROOT / ".venv-sglang-router", [[SGLANG_ROUTER]], SGLANG_ROUTER)
    tables, chart = [], {}
    with tempfile.TemporaryDirectory(prefix="kvcr-bench-vs-sgr-") as tmp:
        run = Path(tmp)
        model = build_model(run / "model")
        for name in args.workloads:
            workload = workloads[name]
            got = measure(workload, repeats, run, model, sgr_python, systems)
            lines, _ = report(workload, got)
            print("\n".join(lines), flush=True)
            tables.append(lines)
            chart[name] = {s.name: [r.mean_ttft for r in got[s.name]] for s in systems}
    intro = (f"Two live SGLang 0.5.23 engines on the CPU harness (tiny Llama, 16-token pages, 4096-token device "
             f"pools), SGLang's own client (`sglang.benchmark.serving`, generated-shared-prefix, 8 output "
             f"tokens), {repeats} repeat(s) alternated A B … B A on each set of engines, device, host and L3 "
             f"caches emptied before every run. Figures: median (min–max) over repeats. `vs anchor` pairs each prompt with the anchor's "
             f"run of the same repeat. {machine_line()}. Command: `.venv/bin/python bench/vs_sglang_router.py`.")
    publish("vs-sglang-router", "kvcr beside sglang-router, on SGLang's benchmark client", intro, tables,
            write=not (args.quick or args.no_write or args.only), chart=chart, unit="mean TTFT (ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
