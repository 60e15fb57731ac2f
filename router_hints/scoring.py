"""Choosing a worker (Dynamo's default cost model) and a source to pull the rest from. Pure."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from kvcr.proto.hints import build_envelope

from .index import NO_OVERLAP, InventoryIndex, Overlap, Worker


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    host_cache_hit_weight: float = 0.75   # the engine's host pool: it loads host -> device itself
    runner_dram_hit_weight: float = 0.5   # a runner's DRAM: an L3 prefetch into the host pool first
    disk_cache_hit_weight: float = 0.25
    peer_pull_weight: float = 0.0         # a block a peer's runner holds past the candidate's own: pulled on the hint
    prefill_load_scale: float = 1.0
    decode_active_request_weight: float = 0.0
    temperature: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    active_prefill_tokens: int = 0
    active_prefill_blocks: int = 0
    potential_decode_blocks: int = 0
    active_requests: int = 0


IDLE = Load()      # a candidate without a load entry


@dataclass(frozen=True, slots=True)
class Choice:
    worker: Worker
    cost: float
    overlap: Overlap
    costs: dict[Worker, float]


def cost(model: CostModel, overlap: Overlap, load: Load, request_blocks: int, block_size: int,
         min_active_prefill: int, pullable: int = 0) -> float:
    """Dynamo's cost in blocks, plus credit for the `pullable` blocks a peer would hand over."""
    credit = 0.0
    if overlap.device:  # the decay only scales device credit
        decay = 1.0 / (1.0 + model.overlap_score_credit_decay * (
            (load.active_prefill_tokens - min_active_prefill) / block_size) / max(1, request_blocks))
        credit = model.overlap_score_credit * decay * overlap.device
    credit += (model.host_cache_hit_weight * overlap.host + model.runner_dram_hit_weight * overlap.dram
               + model.disk_cache_hit_weight * overlap.disk + model.peer_pull_weight * pullable)
    return (model.prefill_load_scale * max(0.0, load.active_prefill_blocks + request_blocks - credit)
            + load.potential_decode_blocks + model.decode_active_request_weight * load.active_requests)


def choose(model: CostModel, candidates: list[Worker], overlaps: dict[Worker, Overlap], loads: dict[Worker, Load],
           request_blocks: int, block_size: int, rng: random.Random | None = None, *,
           models: Mapping[Worker, CostModel] | None = None, pullable: Mapping[Worker, int] | None = None) -> Choice:
    """The lowest-cost candidate; ties go to the lowest (worker id, DP rank), or softmax sampling
    over normalised costs when the model has a temperature. `models`: a candidate's own tier
    weights (measured), else `model`'s; `pullable`: blocks a peer would hand each candidate."""
    models, pullable = models or {}, pullable or {}
    if not candidates:
        raise ValueError("no candidate workers")
    min_prefill = min(loads.get(w, IDLE).active_prefill_tokens for w in candidates) \
        if model.overlap_score_credit_decay else 0  # read by the decay alone
    costs = {w: cost(models.get(w, model), overlaps.get(w, NO_OVERLAP), loads.get(w, IDLE), request_blocks,
                     block_size, min_prefill, pullable.get(w, 0)) for w in candidates}
    lo = min(costs.values())
    if model.temperature > 0:
        span = (max(costs.values()) - lo) or 1.0
        weights = [math.exp(-((costs[w] - lo) / span) / model.temperature) for w in candidates]
        pick = (rng or random.Random()).choices(candidates, weights)[0]
    else:
        tied = [w for w in candidates if costs[w] == lo]
        pick = tied[0] if len(tied) == 1 else min(tied, key=worker_order)
    return Choice(pick, costs[pick], overlaps.get(pick, NO_OVERLAP), costs)


@lru_cache(maxsize=4096)  # asked for every candidate of every decision; workers are few
def worker_order(worker: Worker) -> tuple:
    """Numeric ids (Dynamo's u64 worker ids) in numeric order, others after them by name."""
    worker_id, dp = worker
    return (0, int(worker_id), "", dp) if worker_id.isdigit() else (1, 0, worker_id, dp)


def hint_sources(target: Worker, overlaps: dict[Worker, Overlap], endpoints: dict[Worker, str],
                 roles: dict[Worker, str]) -> list[tuple[Worker, int]]:
    """The peers a hint to `target` may name, with their runners' depth: same role, a control endpoint."""
    role = roles.get(target, "aggregated")
    return [(w, o.runner) for w, o in overlaps.items()
            if w != target and can_serve(w, o, endpoints) and roles.get(w, "aggregated") == role]


def can_serve(worker: Worker, overlap: Overlap, endpoints: dict[Worker, str]) -> bool:
    """A hint may name this worker: its runner holds blocks and takes pulls (a control endpoint)."""
    return bool(overlap.runner and endpoints.get(worker))


def pullable_blocks(candidates: list[Worker], overlaps: dict[Worker, Overlap], endpoints: dict[Worker, str],
                    roles: dict[Worker, str]) -> dict[Worker, int]:
    """Per candidate, the blocks past its own depth that the deepest peer's runner would hand it
    (none to one without a runner to take the hint). Asked per request: one pass over the holders."""
    deepest: dict[str, list[tuple[int, Worker]]] = {}  # per role, the two deepest runners that can serve
    for w, o in overlaps.items():
        if can_serve(w, o, endpoints):
            top = deepest.setdefault(roles.get(w, "aggregated"), [])
            top.append((o.runner, w))
            top.sort(key=lambda p: -p[0])
            del top[2:]
    out = {}
    for w in candidates:
        peers = deepest.get(roles.get(w, "aggregated"), []) if endpoints.get(w) else []
        depth = next((d for d, source in peers if source != w), 0)
        out[w] = max(0, depth - overlaps.get(w, NO_OVERLAP).depth)
    return out


def choose_source(index: InventoryIndex, target: Worker, seq_hashes: list[int], overlaps: dict[Worker, Overlap],
                  endpoints: dict[Worker, str], roles: dict[Worker, str] | None = None) -> dict | None:
    """A `kv_hint` envelope naming the peer whose runner holds the strictly longest prefix, longer
    than the target holds anywhere (same role, with a control endpoint), ties to the lower id; None
    when no peer's runner beats the target. Blocks only on a peer's device or engine host pool are
    never hinted: its runner cannot serve them."""
    mine = overlaps.get(target, NO_OVERLAP).depth
    peers = [(w, d) for w, d in hint_sources(target, overlaps, endpoints, roles or {}) if d > mine]
    if not peers:
        return None
    source, depth = min(peers, key=lambda p: (-p[1], worker_order(p[0])))
    hashes = index.external_hashes(source, seq_hashes[:depth])
    return build_envelope(endpoints[source], hashes) if hashes else None


def hinted_hashes(envelope: dict | None) -> list[int]:
    """The block hashes an envelope `choose_source` built names (its first kv.fetch action)."""
    if envelope is None:
        return []
    return list(envelope["actions"][0]["payload"]["block_hashes"])
