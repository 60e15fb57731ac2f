"""Real `kvcr worker` and `kvcr router` processes for the HTTP tests and the demo's tests."""

from __future__ import annotations

import json
from pathlib import Path

from kvcr.demo.httpc import http  # noqa: F401 (the tests' client)
from kvcr.demo.procs import Child

# A small model keeps the tests quick; pages are 2 layers x K,V x 16 tokens x 64 floats = 16 KiB.
SMALL_MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4"]


def worker(tmp: Path, name: str, *extra: str) -> Child:
    return Child(tmp, name, ["worker", "--name", name, "--port", "0", *SMALL_MODEL, "--set",
                            f"runner.state_dir={tmp / (name + '.state')}", "--set", "dram.size=16Mi", *extra])


def router(tmp: Path, workers: list[Child], name: str = "router", **router_keys) -> Child:
    cfg = {"router": {"port": 0, **router_keys},
           "workers": [{"name": w.info["kvcr_runner"]["name"], "url": w.url} for w in workers]}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return Child(tmp, name, ["router", "--config", str(path)])
