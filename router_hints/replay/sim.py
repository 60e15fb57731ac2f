"""The replay simulation: requests in arrival order through N simulated workers, routed by the
router's own InventoryIndex, cost model and source choice. Pure: time is the trace's.

Per request: the policy picks a worker; the worker reuses the leading blocks it holds (DRAM, then
NVMe) and, under kvcr, pulls what the hinted peer holds beyond that; the rest is recomputed. A
worker serves its queue in order: TTFT = queueing + (NVMe read + pull + recompute) time. Then
the request's blocks fill the worker's caches and the caches' events feed the index.
"""

from __future__ import annotations

import statistics
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvcr.proto.events import EventBatch
from kvcr.proto.hints import parse_envelope
from kvcr.proto.tokenhash import dynamo_block_sequence_hashes

from router_hints.index import InventoryIndex, Overlap, Worker
from router_hints.scoring import CostModel, Load, choose, choose_source
from .caches import SIM_BLOCK, WorkerCache, block_token
from .trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

POLICIES = ("round_robin", "kv", "kvcr", "ideal")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    workers: int = 8
    dram_blocks: int = 4000       # per worker
    nvme_blocks: int = 0          # per worker (0: no NVMe tier)
    prefill_tokens_per_s: float = 8000.0
    decode_tokens_per_s: float = 0.0  # 0: decode not modelled (a worker is busy only while prefilling)
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    kv_bytes_per_token: int = 131072  # Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes
    link_gbps: float = 25.0       # GB/s between workers (a peer pull)
    claim_rtt_s: float = 0.0005   # confirm + release round trips of one pull
    nvme_gbps: float = 5.0        # GB/s reading local NVMe blocks
    speedup: float = 1.0          # arrivals this many times faster than the trace's

    def __post_init__(self) -> None:
        for name, value in (("workers", self.workers), ("prefill_tokens_per_s", self.prefill_tokens_per_s),
                            ("block_tokens", self.block_tokens), ("link_gbps", self.link_gbps),
                            ("nvme_gbps", self.nvme_gbps), ("speedup", self.speedup)):
            if not value > 0:
                raise ValueError(f"{name} = {value} must be > 0")
        for name, value in (("dram_blocks", self.dram_blocks), ("nvme_blocks", self.nvme_blocks),
                            ("decode_tokens_per_s", self.decode_tokens_per_s),
                            ("kv_bytes_per_token", self.kv_bytes_per_token), ("claim_rtt_s", self.claim_rtt_s)):
            if value < 0:
                raise ValueError(f"{name} = {value} must be >= 0")

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    blocks: int = 0
    reused: dict[str, int] = field(default_factory=lambda: {"dram": 0, "nvme": 0, "peer": 0})
    recomputed_tokens: int = 0
    pulled_blocks: int = 0
    pulls: int = 0
    ttft_s: list[float] = field(default_factory=list)
    prefill_tokens_by_worker: list[int] = field(default_factory=list)
    requests_by_worker: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def reuse(self) -> float:
        return sum(self.reused.values()) / self.blocks if self.blocks else 0.0

    def summary(self, block_bytes: int) -> dict:
        ttft = sorted(self.ttft_s)
        loads = self.prefill_tokens_by_worker
        mean_load = statistics.fmean(loads) if loads else 0.0
        return {"requests": self.requests, "blocks": self.blocks, "reuse": round(self.reuse, 6),
                "reuse_by_tier": {k: round(v / self.blocks, 6) if self.blocks else 0.0 for k, v in self.reused.items()},
                "recomputed_tokens": self.recomputed_tokens, "pulled_blocks": self.pulled_blocks,
                "pulled_bytes": self.pulled_blocks * block_bytes, "pulls": self.pulls,
                "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p99_s": _quantile(ttft, 0.99),
                "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
                "load_imbalance": max(loads) / mean_load if mean_load else 1.0,
                "requests_by_worker": self.requests_by_worker,
                "simulated_requests_per_s": round(self.requests / self.wall_s) if self.wall_s else None}


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class _Workers:
    """Queues of N workers: when each is free again, what each prefilled."""

    def __init__(self, cfg: SimConfig, n: int) -> None:
        self.cfg = cfg
        self.busy_until = [0.0] * n
        self.prefilled = [0] * n
        self.served = [0] * n

    def loads(self, names: Sequence[Worker], now: float) -> dict[Worker, Load]:
        """The router's view of each busy worker: its backlog in prefill tokens (idle ones: none)."""
        rate, per_block = self.cfg.prefill_tokens_per_s, self.cfg.block_tokens
        out = {}
        for name, until in zip(names, self.busy_until):
            if until > now:
                tokens = int((until - now) * rate)
                out[name] = Load(active_prefill_tokens=tokens, active_prefill_blocks=tokens // per_block)
        return out

    def serve(self, w: int, now: float, load_s: float, recompute: int, output: int) -> float:
        """Queue a request's work on worker w; returns its TTFT."""
        start = max(now, self.busy_until[w])
        first_token = start + load_s + recompute / self.cfg.prefill_tokens_per_s
        decode = output / self.cfg.decode_tokens_per_s if self.cfg.decode_tokens_per_s else 0.0
        self.busy_until[w] = first_token + decode
        self.prefilled[w] += recompute
        self.served[w] += 1
        return first_token - now


class Simulation:
    def __init__(self, cfg: SimConfig, policy: str, model: CostModel | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        self.cfg, self.policy = cfg, policy
        self.model = model or CostModel()
        n = 1 if policy == "ideal" else cfg.workers
        self.caches = [WorkerCache(cfg.dram_blocks * (cfg.workers if policy == "ideal" else 1),
                                   cfg.nvme_blocks * (cfg.workers if policy == "ideal" else 1)) for _ in range(n)]
        self.queues = _Workers(cfg, cfg.workers)
        self.index = InventoryIndex(block_size=SIM_BLOCK)
        self.names = [(str(i), 0) for i in range(cfg.workers)]
        self.endpoints = {w: f"sim://{w[0]}" for w in self.names}
        self.result = PolicyResult(policy)
        self._indexed = policy in ("kv", "kvcr")  # the policies that read the index: only they feed it
        self._next = 0
        self._seq: dict[int, int] = {}

    # --- one request ----------------------------------------------------------------------------

    def step(self, req: TraceRequest) -> None:
        now = req.arrival_s / self.cfg.speedup
        blocks = req.blocks
        seq = self._sequence_hashes(blocks) if self._indexed else []
        overlaps = self.index.overlaps(seq) if self._indexed else {}
        w = self._route(now, overlaps, len(blocks))
        cache = self.caches[0 if self.policy == "ideal" else w]
        dram, nvme = cache.reusable(blocks)
        peer = self._pull(w, blocks, seq, overlaps, dram + nvme) if self.policy == "kvcr" else 0
        reused = dram + nvme + peer
        recompute = max(0, req.input_length - reused * self.cfg.block_tokens)
        load_s = (nvme * self.cfg.block_bytes / (self.cfg.nvme_gbps * 1e9)
                  + (self.cfg.claim_rtt_s + peer * self.cfg.block_bytes / (self.cfg.link_gbps * 1e9) if peer else 0.0))
        r = self.result
        r.ttft_s.append(self.queues.serve(w, now, load_s, recompute, req.output_length))
        r.requests += 1
        r.blocks += len(blocks)
        r.reused["dram"] += dram
        r.reused["nvme"] += nvme
        r.reused["peer"] += peer
        r.recomputed_tokens += recompute
        events = cache.fill(blocks, publish=self._indexed)
        if events:
            self.index.apply(self.names[w][0], EventBatch(ts=now, events=tuple(events)))

    def _sequence_hashes(self, blocks: Sequence[int]) -> list[int]:
        """The index's sequence hashes of a request, by block: an id stands for its whole prefix,
        so each block's hash is computed once (with the index's own functions) and remembered."""
        memo = self._seq
        out = list(map(memo.get, blocks))
        if None not in out:
            return out
        first = out.index(None)  # new blocks extend a known prefix: hash them in one call
        tail = blocks[first:]
        out[first:] = dynamo_block_sequence_hashes(array("I", map(block_token, tail)), SIM_BLOCK,
                                                   parent=out[first - 1] if first else None)
        memo.update(zip(tail, out[first:]))
        return out

    def _route(self, now: float, overlaps: dict, num_blocks: int) -> int:
        if self.policy == "round_robin":
            self._next += 1
            return (self._next - 1) % self.cfg.workers
        if self.policy == "ideal":  # one cache seen by all: only the queues differ
            return min(range(self.cfg.workers), key=lambda i: (self.queues.busy_until[i], i))
        choice = choose(self.model, self.names, overlaps, self.queues.loads(self.names, now), max(1, num_blocks),
                        SIM_BLOCK)
        return int(choice.worker[0])

    def _pull(self, w: int, blocks: Sequence[int], seq: list[int], overlaps: dict, local: int) -> int:
        """Blocks the hinted peer holds beyond the target's own run (kvcr's hint, parsed as the
        worker parses it); the peer's copies are touched, as its claim does."""
        target = self.names[w]
        own = overlaps.get(target, Overlap()).depth
        envelope = choose_source(self.index, target, seq, overlaps, self.endpoints)
        if envelope is None:
            return 0
        hint = parse_envelope(envelope)
        source = int(hint.source_control_endpoint.removeprefix("sim://"))
        depth = len(hint.block_hashes)
        if depth <= max(local, own):
            return 0
        held = self.caches[source]
        held.dram.touch(blocks[:depth])
        held.nvme.touch(blocks[:depth])
        self.result.pulls += 1
        self.result.pulled_blocks += depth - local
        return depth - local

    def run(self, trace: Sequence[TraceRequest], progress: Callable[[int], None] | None = None) -> PolicyResult:
        t0 = time.perf_counter()
        for i, req in enumerate(trace):
            self.step(req)
            if progress is not None and i % 1000 == 999:
                progress(1000)
        if progress is not None:
            progress(len(trace) % 1000)
        self.result.wall_s = time.perf_counter() - t0
        self.result.prefill_tokens_by_worker = list(self.queues.prefilled)
        self.result.requests_by_worker = list(self.queues.served)
        return self.result


def simulate(trace: Sequence[TraceRequest], cfg: SimConfig, policies: Sequence[str] = POLICIES,
             progress: Callable[[str, int], None] | None = None) -> dict[str, PolicyResult]:
    return {p: Simulation(cfg, p).run(trace, (lambda n, p=p: progress(p, n)) if progress else None)
            for p in policies}
