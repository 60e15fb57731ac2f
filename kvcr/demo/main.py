"""`kvcr demo`: start a router and N workers on loopback, drive the workload, check every answer
served from cached KV against the oracle, then write summary.json and chart.png.

`--engine worker` (the default) runs `kvcr worker` processes; `--engine sglang` runs live SGLang
0.5.23 engines with kvcr's backend instead (sglang_adapter/demo.py, found through the
`kvcr.demos` entry point)."""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path

from ..drivers.shm import sweep_stale
from .base import Demo, DemoUnavailable, _say


ENGINES = ("worker", "sglang")
ROUTERS = ("kvcr", "dynamo")
# --engine sglang's own defaults for the options not given (argparse holds the worker's)
SGLANG_DEFAULTS = {"workers": 2, "dram": "1Mi"}
DEMOS_GROUP = "kvcr.demos"  # engine name -> a callable returning its Demo class (pyproject.toml)


class _Given(argparse.Action):
    """Store the value and note that it was given, so per-engine defaults apply only to the others."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, "_given", getattr(namespace, "_given", frozenset()) | {self.dest})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="worker", choices=ENGINES,
                   help="worker: `kvcr worker` processes (torch model); sglang: live SGLang 0.5.23 engines with "
                        "kvcr's backend, plus a reference engine for the oracle (needs `make sglang-setup`)")
    p.add_argument("--router", default="kvcr", choices=ROUTERS,
                   help="kvcr: our reference router; dynamo: Dynamo 1.6.1's unmodified frontend and KV router "
                        "(needs `make dynamo-setup`; --engine worker only)")
    p.add_argument("--workers", type=int, default=3, action=_Given,
                   help="engines behind the router (default 3; sglang: 2)")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (at least 2)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--transport", default="get", choices=("get", "tag", "shm", "auto"),
                   help="peer pulls: UCX RMA get, UCX tagged send, or a same-host shared-memory copy")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--dram", default="8Mi", action=_Given,
                   help="kvcr DRAM pool per worker (small, so NVMe is used too; default 8Mi, sglang: 1Mi)")
    p.add_argument("--layers", type=int, default=6, help="worker engine's model (sglang: a fixed tiny Llama)")
    p.add_argument("--hidden", type=int, default=256, help="worker engine's model (sglang: a fixed tiny Llama)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="kvcr-demo", help="where summary.json, chart.png and logs go")
    p.add_argument("--hold", action="store_true", help="keep everything running for inspection until Ctrl-C")
    p.add_argument("--no-live", action="store_true", help="plain progress lines instead of the live table")


def contributed_demo(engine: str) -> type["Demo"]:
    """The Demo class a package above kvcr contributes for `engine` (SGLang's: sglang_adapter)."""
    found = [e for e in entry_points(group=DEMOS_GROUP) if e.name == engine]
    if not found:
        raise DemoUnavailable(f"no package provides the {engine!r} engine's demo (entry point group "
                              f"{DEMOS_GROUP!r}); reinstall kvcr with `make setup`")
    try:
        prepare = found[0].load()
    except ImportError as exc:
        raise DemoUnavailable(f"the {engine!r} engine's demo ({found[0].value}) cannot be imported: {exc}") from None
    return prepare()


def _verdict(summary: dict) -> list[str]:
    problems = [f"request failed: {e}" for e in summary["errors"]]
    if summary["oracle"]["mismatches"]:
        what = "a cold computation on the reference engine" if summary["engine"] == "sglang" else \
            "a local recomputation"
        problems.append(f"ORACLE MISMATCH: {summary['oracle']['mismatches']} answers served from cached KV differ "
                        f"from {what}")
    control = summary["oracle"].get("control")
    if summary["engine"] == "sglang" and summary["oracle"]["checks"] and not (control and control["detected"]):
        problems.append(f"the oracle's control (one prompt token changed) was not detected: {control}; the "
                        "oracle cannot tell right KV from wrong")
    if summary["oracle"].get("prompt_ids_mismatches"):
        problems.append(f"{summary['oracle']['prompt_ids_mismatches']} prompts: the token ids the router hashed "
                        "differ from the engine's")
    if summary["peer_hits"] == 0:
        problems.append("no page was pulled from a peer")
    return problems


def _finish(demo: Demo, outcomes: list, elapsed: float) -> int:
    from rich.console import Console

    from .report import chart, summarize, summary_table

    a = demo.args
    options = {k: v for k, v in vars(a).items() if k != "func"}
    summary = summarize(outcomes, demo.snapshot(), page_size=a.page_size, elapsed_s=elapsed, options=options,
                        engine=demo.engine)
    if demo.feed is not None and demo.feed.control is not None:
        summary["oracle"]["control"] = demo.feed.control
    summary["router"] = demo.router_kind
    if demo.router_kind == "dynamo":
        summary["dynamo_hints"] = sum(bool(o.hinted) for o in outcomes)
    problems = _verdict(summary)
    summary["ok"] = not problems
    summary["problems"] = problems
    (demo.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    chart(summary, demo.run_dir / "chart.png")
    console = Console(stderr=True)
    console.print(summary_table(summary))
    o = summary["oracle"]
    if demo.engine == "sglang":
        c = o.get("control") or {}
        _say(f"[4/4] {summary['peer_hits']} pages pulled from peers; oracle: {o['checks']} answers from cached KV, "
             f"{o['output_ids_equal']} with the cold reference's output token ids, {o['bitwise_equal']} with its "
             f"logprobs (and top-{o['top_logprobs']}) bitwise, max |Δ logprob| {o['max_abs_logprob']:.2e} (limit "
             f"{o['tolerance']:.0e}); control, one prompt token changed: |Δ| {c.get('max_abs_logprob', 0):.2e}, "
             f"output ids {'changed' if c.get('output_ids_changed') else 'unchanged'}")
    else:
        _say(f"[4/4] {summary['peer_hits']} pages pulled from peers; oracle: {o['checks']} answers from cached KV, "
             f"{o['chunked_bitwise_equal']} bitwise equal to a local run, max |Δ| vs one-shot prefill "
             f"{o['max_abs_vs_one_shot']:.2e} (limit 1e-4)")
    if demo.router_kind == "dynamo":
        _say(f"      Dynamo's KV router decided every request and attached {summary['dynamo_hints']} kv_hints")
    _say(f"      wrote {demo.run_dir / 'summary.json'} and {demo.run_dir / 'chart.png'}")
    for p in problems:
        _say(f"demo FAILED: {p}")
    if not problems:
        _say("demo OK")
    return 0 if not problems else 1


def _hold(demo: Demo) -> None:
    _say("holding (Ctrl-C to stop). Try:\n" + demo.hold_text())
    while True:
        time.sleep(3600)


def _resolve(args: argparse.Namespace) -> None:
    given = getattr(args, "_given", frozenset())
    if hasattr(args, "_given"):
        del args._given  # not an option (the summary lists them)
    if args.engine == "sglang":
        for key, value in SGLANG_DEFAULTS.items():
            if key not in given:
                setattr(args, key, value)


def run(args: argparse.Namespace) -> int:
    _resolve(args)
    demo_class = Demo
    if args.router == "dynamo":
        if args.engine != "worker":
            _say("kvcr demo --router dynamo runs `kvcr worker` engines only (SGLang behind Dynamo: docs/dynamo.md)")
            return 2
        from ..dynamo.launch import DynamoSetupError, dynamo_python
        from .dynamo_router import DynamoDemo

        try:
            dynamo_python()
        except DynamoSetupError as exc:
            _say(f"kvcr demo --router dynamo: {exc}")
            return 2
        demo_class = DynamoDemo
    if args.engine == "sglang":
        try:
            demo_class = contributed_demo("sglang")
        except DemoUnavailable as exc:
            _say(f"kvcr demo --engine sglang: {exc}")
            return 2
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "chart.png"):
        (run_dir / stale).unlink(missing_ok=True)
    # SIGTERM takes the same way out as Ctrl-C: every child is stopped, the temp dir removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="kvcr-demo-") as tmp:
        demo = demo_class(args, run_dir, Path(tmp))
        rc = None
        try:
            demo.start()
            rc = _finish(demo, *demo.drive())
            if args.hold:
                _hold(demo)
            return rc
        except KeyboardInterrupt:  # after --hold, Ctrl-C is the normal way out: the verdict stands
            _say("stopping workers and router")
            return 130 if rc is None else rc
        finally:
            # A signal during the (bounded) shutdown must not cut it short and leave children behind,
            # nor replace the exit code with death by SIGINT.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            demo.stop()
            sweep_stale()  # regions of a child that had to be killed
