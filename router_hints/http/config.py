"""The reference router's config: strict, and every error names the key."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..scoring import CostModel

ENGINES = ("kvcr-worker", "sglang")


class RouterConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    name: str
    url: str            # the engine's HTTP base URL
    runner: str         # its runner's info endpoint (http:// or tcp:// control); "" = from the engine's /server_info
    role: str = "aggregated"
    engine: str = "kvcr-worker"  # "sglang": its runner must be named (`runner`), /server_info lacks it
    runner_token: str = ""       # the runner's runner.http_token, when `runner` is its http:// endpoint


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str
    port: int
    block_size: int
    tokenizer: str
    model: str
    request_timeout_s: float
    attach_hints: bool
    post_hints: bool
    operator_token: str  # X-KVCR-Target, /debug/index, /admin need `Authorization: Bearer <it>` ("": loopback only)
    dead_after_s: float  # a runner's event stream silent this long: the worker is down (0: never)
    discovery_dir: str   # info files `kvcr worker --info-file` writes there join (and, removed, leave)
    dynamo_discovery: str  # Dynamo's etcd (http://HOST:2379): the kvcr workers registered there join and leave
    dynamo_namespace: str  # the Dynamo namespace they register in
    max_retries: int       # a request whose worker failed before its first byte goes to the next best, this often
    retry_backoff_s: float  # the wait before a retry, doubling per retry
    breaker_failures: int  # failures in a row that take a worker out of routing (a refused connection: one)
    health_interval_s: float  # how often a worker out of routing (or whose events stopped) is health-checked
    cost: CostModel
    measure_costs: bool  # cost.measured: tier weights from each worker's measured rates (else `cost` alone)
    workers: tuple[WorkerEntry, ...]


def _typed(key: str, value: Any, tp: type) -> Any:
    ok = isinstance(value, tp) and not (tp is not bool and isinstance(value, bool))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise RouterConfigError(f"{key} must be {tp.__name__}, got {value!r}")
    return value


def _section(raw: Any, key: str, spec: dict[str, tuple[type, Any]]) -> dict:
    if not isinstance(raw, dict):
        raise RouterConfigError(f"{key} must be a table")
    unknown = sorted(set(raw) - set(spec), key=repr)  # keys of any type: named, not compared
    if unknown:
        raise RouterConfigError(f"{key}.{unknown[0]} is not a known key (known: {', '.join(sorted(spec))})")
    return {k: _typed(f"{key}.{k}", raw.get(k, default), tp) for k, (tp, default) in spec.items()}


ROUTER_KEYS = {"host": (str, "127.0.0.1"), "port": (int, 8000), "block_size": (int, 16), "tokenizer": (str, ""),
               "model": (str, "kvcr"), "request_timeout_s": (float, 600.0), "attach_hints": (bool, True),
               "post_hints": (bool, True), "operator_token": (str, ""), "dead_after_s": (float, 5.0),
               "discovery_dir": (str, ""), "dynamo_discovery": (str, ""), "dynamo_namespace": (str, "kvcr"),
               "max_retries": (int, 2), "retry_backoff_s": (float, 0.05), "breaker_failures": (int, 3),
               "health_interval_s": (float, 1.0)}
WORKER_KEYS = {"name": (str, None), "url": (str, None), "runner": (str, ""), "role": (str, "aggregated"),
               "engine": (str, "kvcr-worker"), "runner_token": (str, "")}
# CostModel's weights, and whether measured rates replace them per worker (router_hints/rates.py)
COST_KEYS = {**{f.name: (float, f.default) for f in fields(CostModel)}, "measured": (bool, True)}


def parse_worker(raw: Any, key: str = "worker") -> WorkerEntry:
    """One worker entry (a config's workers[i], or the body of an admin call)."""
    if isinstance(raw, dict):
        for req in ("name", "url"):
            if req not in raw:
                raise RouterConfigError(f"{key}.{req} is required")
    w = _section(raw, key, WORKER_KEYS)
    if not w["url"].startswith(("http://", "https://")):
        raise RouterConfigError(f"{key}.url = {w['url']!r} must be an http:// URL")
    if w["engine"] not in ENGINES:
        raise RouterConfigError(f"{key}.engine = {w['engine']!r} must be one of {ENGINES}")
    if w["engine"] == "sglang" and not w["runner"]:  # SGLang's /server_info does not name our runner
        raise RouterConfigError(f"{key}.runner is required for engine 'sglang' (its runner's http:// or tcp:// "
                                "control endpoint)")
    return WorkerEntry(**w)


def parse_router_config(raw: dict) -> RouterConfig:
    unknown = sorted(set(raw) - {"router", "cost", "workers"}, key=repr)
    if unknown:
        raise RouterConfigError(f"{unknown[0]} is not a known section (router, cost, workers)")
    r = _section(raw.get("router", {}), "router", ROUTER_KEYS)
    cost_keys = _section(raw.get("cost", {}), "cost", COST_KEYS)
    measure_costs = cost_keys.pop("measured")
    cost = CostModel(**cost_keys)
    workers = raw.get("workers", [])
    if not isinstance(workers, list) or not (workers or r["discovery_dir"] or r["dynamo_discovery"]):
        raise RouterConfigError("workers must list at least one worker (or set router.discovery_dir or "
                                "router.dynamo_discovery)")
    if r["dynamo_discovery"] and not r["dynamo_discovery"].startswith(("http://", "https://")):
        raise RouterConfigError(f"router.dynamo_discovery = {r['dynamo_discovery']!r} must be etcd's http:// URL")
    entries = tuple(parse_worker(w, f"workers[{i}]") for i, w in enumerate(workers))
    names = [w.name for w in entries]
    if len(set(names)) != len(names):
        raise RouterConfigError(f"workers has a duplicate name in {names}")
    if r["block_size"] < 1:
        raise RouterConfigError(f"router.block_size = {r['block_size']} must be >= 1")
    if not 0 <= r["port"] < 65536:
        raise RouterConfigError(f"router.port = {r['port']} is not a port")
    if r["dead_after_s"] < 0:
        raise RouterConfigError(f"router.dead_after_s = {r['dead_after_s']} must be >= 0 (0: never)")
    if not 0 <= r["max_retries"] <= 10:
        raise RouterConfigError(f"router.max_retries = {r['max_retries']} must be in 0..10")
    if not 0 <= r["retry_backoff_s"] <= 10:
        raise RouterConfigError(f"router.retry_backoff_s = {r['retry_backoff_s']} must be in 0..10")
    if r["breaker_failures"] < 1:
        raise RouterConfigError(f"router.breaker_failures = {r['breaker_failures']} must be >= 1")
    if not 0 < r["health_interval_s"] <= 60:
        raise RouterConfigError(f"router.health_interval_s = {r['health_interval_s']} must be in (0, 60]")
    if r["operator_token"] and len(r["operator_token"]) < 16:
        raise RouterConfigError("router.operator_token must be at least 16 characters")
    return RouterConfig(**r, cost=cost, measure_costs=measure_costs, workers=entries)


def load_router_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RouterConfig:
    text = Path(path).read_text()
    try:
        raw = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RouterConfigError(f"{path}: {exc}") from None
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in ("router", "cost") or not key:
            raise RouterConfigError(f"--set {dotted}: only router.* and cost.* keys can be overridden")
        raw.setdefault(section, {})[key] = value
    return parse_router_config(raw)
