"""What every engine's demo shares: the `kvcr worker` demo (Demo), which the SGLang and Dynamo
variants extend, and how it follows the workload driver's outcomes while it runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..drivers.ucx_env import SINGLE_HOST_UCX_ENV
from .driver import Outcome
from .httpc import get_json
from .procs import Child, stop_all, worker_command


class DemoUnavailable(RuntimeError):
    """An engine's demo cannot run here; the message names the fix."""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Demo:
    """The `kvcr worker` variant; SGLangDemo (sglang_adapter/demo.py) replaces the engines."""

    engine = "worker"
    router_kind = "kvcr"

    def __init__(self, args: argparse.Namespace, run_dir: Path, tmp: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.tmp = tmp
        self.env = {**SINGLE_HOST_UCX_ENV, **os.environ}
        self.children: list[Child] = []
        self.workers: list[Child] = []
        self.router: Child | None = None
        self.feed: OutcomeFeed | None = None

    def start(self) -> None:
        a, logs = self.args, self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        _say(f"[1/4] starting {a.workers} workers (torch model {a.layers}x{a.hidden}, runner with DRAM {a.dram} "
             f"+ NVMe in {self.tmp}, UCX peer server)")
        for i in range(a.workers):
            name, base = f"w{i}", self.tmp / f"w{i}"
            self.children.append(Child(logs, name, worker_command(
                name, base, page_size=a.page_size, layers=a.layers, hidden=a.hidden, seed=a.seed, dram=a.dram,
                transport=a.transport), self.env))
            self.workers.append(self.children[-1])
            self.children[-1].start()  # registered first: a failed start is still stopped
        for w in self.workers:
            w.wait_ready()
        cfg = {"router": {"port": 0, "block_size": a.page_size},
               "workers": [{"name": w.name, "url": w.url} for w in self.workers]}
        self.start_router(cfg, logs, "")
        for w in self.workers:
            ep = w.info["kvcr_runner"]["endpoints"]
            _say(f"      {w.name} {w.url}/metrics  runner control {ep['control']}  events {ep['events']}")

    @property
    def worker_names(self) -> list[str]:
        return [w.name for w in self.workers]

    def snapshot(self) -> dict[str, dict]:
        """Per worker: {"tiers": its runner's tiers, "stats": its request counts} (the live table, the summary)."""
        return {w.name: get_json(w.url + "/server_info") for w in self.workers}

    def start_router(self, cfg: dict, logs: Path, note: str) -> None:
        """`kvcr router` over the engines in `cfg`, up and announced (step 2 of 4)."""
        (self.tmp / "router.json").write_text(json.dumps(cfg))
        _say(f"[2/4] starting the router (subscribes to every runner's event stream{note})")
        self.router = Child(logs, "router", ["router", "--config", str(self.tmp / "router.json")], self.env)
        self.children.append(self.router)
        self.router.start()
        self.router.wait_ready()
        _say(f"      router {self.router.url}  (/metrics, /debug/index)")

    def router_url(self) -> str:
        return self.router.url

    def driver_args(self) -> list[str]:
        return []

    def drive(self) -> tuple[list, float]:
        """Run the workload driver (its own process) and watch it until it is done."""
        a = self.args
        out = self.tmp / "outcomes.jsonl"
        driver = Child(self.run_dir / "logs", "driver", [
            "demo-driver", "--router", self.router_url(), "--workers", ",".join(self.worker_names),
            "--out", str(out), "--seed", str(a.seed), "--conversations", str(a.conversations),
            "--turns", str(a.turns), "--max-tokens", str(a.max_tokens), *self.driver_args()], self.env)
        self.children.append(driver)
        start = time.monotonic()
        driver.start()
        plan = driver.wait_ready()
        _say(f"[3/4] workload (driver pid {plan['pid']}): {a.conversations} conversations x {a.turns} turns in "
             f"phases {', '.join(plan['phases'])} ({plan['requests']} requests)")
        feed = self.feed = OutcomeFeed(out)
        _watch(self, feed, driver, plan["requests"])
        feed.read()
        if not feed.done:
            raise RuntimeError(f"the workload driver exited with code {driver.proc.returncode}:\n"
                               f"{driver.log_path.read_text()[-2000:]}")
        return feed.outcomes, time.monotonic() - start

    def hold_text(self) -> str:
        w = self.workers[0].info["kvcr_runner"]["endpoints"]
        return (f"  kvcr info {w['control']}\n"
                f"  kvcr events tail --endpoint {w['events']} --replay {w['replay']} --snapshot {w['control']}\n"
                f"  curl -s {self.router.url}/metrics | grep kvcr_router")

    def stop(self) -> None:
        stop_all(self.children)


class OutcomeFeed:
    """The driver's JSON lines, read as they are appended: the phase, the outcomes, the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.phase = "starting"
        self.outcomes: list[Outcome] = []
        self.control: dict | None = None  # SGLang: the oracle's negative control (sglang_driver.py)
        self.done = False

    def read(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            while (line := f.readline()).endswith("\n"):  # a half-written line waits for the next read
                self.offset = f.tell()
                item = json.loads(line)
                if "phase" in item:
                    self.phase = item["phase"]
                elif "outcome" in item:
                    self.outcomes.append(Outcome(**item["outcome"]))
                elif "control" in item:
                    self.control = item["control"]
                else:
                    self.done = self.done or bool(item.get("done"))


def _watch(demo: Demo, feed: OutcomeFeed, driver: Child, total: int) -> None:
    """The live view (rich) while the driver runs; plain lines when not on a terminal."""
    from rich.console import Console
    from rich.live import Live

    from .report import live_table, oracle_summary

    console = Console(stderr=True)
    last_events: dict[str, tuple[float, int]] = {}
    rates: dict[str, float] = {}

    def running() -> bool:
        feed.read()
        return driver.proc.poll() is None and not feed.done

    def frame():
        infos = demo.snapshot()
        now = time.monotonic()
        for name, info in infos.items():
            t0, e0 = last_events.get(name, (now, info["tiers"]["events"]))
            rates[name] = (info["tiers"]["events"] - e0) / (now - t0) if now > t0 else 0.0
            last_events[name] = (now, info["tiers"]["events"])
        return live_table(feed.phase, len(feed.outcomes), total, infos, rates,
                          oracle_summary(feed.outcomes, demo.engine), engine=demo.engine)

    if not demo.args.no_live and console.is_terminal:
        with Live(frame(), console=console, refresh_per_second=4) as view:
            while running():
                time.sleep(0.5)
                view.update(frame())
        return
    last_phase = None
    while running() or last_phase != feed.phase:
        if feed.phase != last_phase:
            last_phase = feed.phase
            _say(f"      phase {feed.phase}: {len(feed.outcomes)}/{total} requests done")
        time.sleep(0.2)
