"""A router's decision loop: follow the publishers, keep the index, pick a target and a source.

`RouterCore` is what an HTTP front (the reference router) or another router embeds: it owns a
Subscriber and an InventoryIndex, and answers `route(tokens)` with the target worker and the
`kv_hint` envelope to attach (or post to the target's runner).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from kvcr.config import CurveKeys
from kvcr.drivers.zmq_subscriber import Delivery, Notice, Subscriber
from kvcr.proto.events import EventBatch

from .active import ActiveBlocks
from .discovery import DiscoveryError, Publisher
from .index import NO_OVERLAP, InventoryIndex, Overlap, Worker
from .liveness import Liveness
from .rates import Rates, Sample
from .scoring import IDLE, Choice, CostModel, Load, choose, choose_source, hinted_hashes, pullable_blocks


@dataclass(frozen=True, slots=True)
class Route:
    choice: Choice
    hint: dict | None  # kv_hint envelope naming a peer with a longer prefix, if any
    request_blocks: int
    overlaps: dict  # per worker holding the first block: its overlap by tier
    seq_hashes: tuple[int, ...] = ()  # the request's blocks (what the target will hold)
    loads: dict = field(default_factory=dict)  # per candidate: the load it was scored with
    hint_blocks: int = 0  # leading blocks the hint names
    pullable: dict = field(default_factory=dict)  # per candidate: blocks a peer's runner would hand it

    def sample(self, seconds: float, *, hinted: bool) -> Sample:
        """What this request measured of its worker's rates, its first byte `seconds` after it was
        sent; `hinted`: the hint reached the worker (else it pulled nothing on it)."""
        o = self.choice.overlap
        pulled = max(0, self.hint_blocks - o.depth) if hinted else 0
        new = max(0, self.request_blocks - o.depth - pulled)
        # a booking can outlive its worker's removal and come back below zero
        ahead = max(0, self.loads.get(self.choice.worker, IDLE).active_prefill_blocks)
        return Sample(new + ahead, o.device, o.host, o.dram, o.disk, pulled, seconds)


def on_device(o: Overlap, ahead: int) -> Overlap:
    """`o` with its first `ahead` blocks on device (more than it holds there): the lower tiers
    keep only what continues past them."""
    cut, rest = ahead - o.device, [o.host, o.dram, o.disk]
    for i, n in enumerate(rest):
        rest[i] -= min(n, cut)
        cut -= min(n, cut)
    return Overlap(device=ahead, host=rest[0], dram=rest[1], disk=rest[2], runner=o.runner)


@dataclass
class RouterCore:
    block_size: int
    model: CostModel = field(default_factory=CostModel)
    rng: random.Random = field(default_factory=random.Random)
    dead_after_s: float = 0.0  # a kvcr runner's stream silent this long: the worker is dead (0: never)
    clock: Callable[[], float] = time.monotonic
    curve: CurveKeys | None = None  # the deployment keypair, for runners whose events speak CURVE
    active_linger_s: float = 5.0  # a routed prefix counts as on its target's device this long after it ends
    measure_costs: bool = True  # score each worker with tier weights measured from its requests (rates.py)

    def __post_init__(self) -> None:
        self.liveness = Liveness(self.dead_after_s)
        self.index = InventoryIndex(block_size=self.block_size)
        self.subscriber = Subscriber(on_unrepaired=self._lost)
        self.publishers: dict[Worker, Publisher] = {}
        self.loads: dict[Worker, Load] = {}
        self.active = ActiveBlocks(self.active_linger_s)  # what requests in flight put on each device
        self.rates = Rates(self.model)
        self.num_batches = 0
        self.num_gaps = self.num_replayed = self.num_snapshots = 0  # how the index was kept whole
        self.needs_snapshot: set[Worker] = set()  # lost a gap replay could not repair
        self.event_lag_s = 0.0  # publish-to-apply delay of the latest batch (publisher clock)

    def add(self, publisher: Publisher) -> None:
        if publisher.events_curve and self.curve is None:
            raise DiscoveryError(f"worker {publisher.worker_id}: its runner's events speak CURVE and the router "
                                 "holds no keys (set KVCR_KEYS_DIR, docs/security.md)")
        worker = (publisher.worker_id, publisher.dp_rank)
        self.publishers[worker] = publisher
        self.subscriber.add(f"{publisher.worker_id}:{publisher.dp_rank}", publisher.events, publisher.replay,
                            self.curve if publisher.events_curve else None)
        if publisher.control:  # a kvcr runner: it heartbeats, so silence means it is gone
            self.liveness.watch(worker, self.clock())

    def moved(self, publisher: Publisher) -> None:
        """A known worker's runner publishes elsewhere now (it restarted on other ports): follow the
        new endpoints; its load is kept (requests to it are still booked) and its inventory is
        reloaded from its snapshot."""
        worker = (publisher.worker_id, publisher.dp_rank)
        if publisher.events_curve and self.curve is None:
            raise DiscoveryError(f"worker {publisher.worker_id}: its runner's events speak CURVE and the router "
                                 "holds no keys (set KVCR_KEYS_DIR, docs/security.md)")
        name = f"{worker[0]}:{worker[1]}"
        self.subscriber.remove(name)
        self.publishers[worker] = publisher
        self.subscriber.add(name, publisher.events, publisher.replay, self.curve if publisher.events_curve else None)
        self.index.clear(worker)
        if publisher.control:
            self.liveness.watch(worker, self.clock())
        self.needs_snapshot.add(worker)

    def remove(self, worker_id: str) -> None:
        """A worker that left: no longer a candidate, its blocks forgotten."""
        for worker in [w for w in self.publishers if w[0] == worker_id]:
            del self.publishers[worker]
            self.loads.pop(worker, None)
            self.active.forget(worker)
            self.rates.forget(worker)
            self.subscriber.remove(f"{worker[0]}:{worker[1]}")
            self.liveness.forget(worker)
            self.needs_snapshot.discard(worker)
        self.index.remove_worker(worker_id)

    def alive(self) -> list[Worker]:
        return sorted(w for w in self.publishers if not self.liveness.is_dead(w))

    def _lost(self, name: str) -> None:
        # Replay could not repair a gap: forget the worker rather than trust a stale view; a kvcr
        # runner's next batch (or heartbeat) brings its clear and re-announcement.
        worker_id, dp = name.rsplit(":", 1)
        self.index.clear((worker_id, int(dp)))
        self.needs_snapshot.add((worker_id, int(dp)))

    def load_snapshot(self, worker: Worker, seq: int, events: list) -> None:
        """Replace what we know of `worker` with its runner's snapshot taken at batch `seq`; the
        live stream continues after it (earlier batches are then stale)."""
        self.index.clear(worker)
        self.index.apply(worker[0], EventBatch(ts=time.time(), events=tuple(events), dp_rank=worker[1]), worker[1])
        self.subscriber.start_after(f"{worker[0]}:{worker[1]}", seq)
        self.needs_snapshot.discard(worker)
        self.num_snapshots += 1

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply whatever arrived; returns the batches applied."""
        n = 0
        for item in self.subscriber.poll(timeout_ms):
            if isinstance(item, Notice) and item.kind == "restart":
                # A publisher whose seq went back restarted: what it held before is gone.
                worker_id, dp = item.publisher.rsplit(":", 1)
                self.index.clear((worker_id, int(dp)))
            elif isinstance(item, Notice):
                self.num_gaps += item.kind == "gap"
            elif isinstance(item, Delivery):
                self.num_replayed += item.replayed
                worker_id, dp = item.publisher.rsplit(":", 1)
                if self.liveness.heard((worker_id, int(dp)), self.clock()):
                    self.needs_snapshot.add((worker_id, int(dp)))  # back: what it holds now is in its snapshot
                self.index.apply(worker_id, item.batch, int(dp))
                if not item.replayed:
                    self.event_lag_s = max(0.0, time.time() - item.batch.ts)
                n += 1
        for worker in self.liveness.expire(self.clock()):
            self.index.clear(worker)  # gone: its pages are no reason to send anything there
        self.num_batches += n
        return n

    def route(self, tokens: list[int], *, lora_name: str | None = None, cache_salt: str | None = None,
              pinned: Worker | None = None, excluded: frozenset[Worker] = frozenset()) -> Route:
        """The cheapest worker and a hint; `pinned` (an operator's override) fixes the target and
        still gets the hint, so the pinned worker pulls what a peer holds. `excluded` workers (their
        requests fail, or this request failed there) are neither target nor source."""
        seq = self.index.sequence_hashes(tokens, lora_name=lora_name, cache_salt=cache_salt)
        overlaps = self.index.overlaps(seq)
        candidates = [w for w in self.alive() if w not in excluded or w == pinned]
        if not candidates:
            raise LookupError("no workers to route to: add publishers first" if not self.publishers else
                              f"every worker is down: {sorted(self.liveness.dead)}" if not excluded else
                              f"no worker left to route to: down {sorted(self.liveness.dead)}, failing "
                              f"{sorted(excluded)}")
        if pinned is not None and pinned not in candidates:
            raise LookupError(f"pinned worker {pinned} is not a known worker" if pinned not in self.publishers
                              else f"pinned worker {pinned} is down (its events stopped)")
        now = self.clock()
        self.active.expire(now)
        loads = {}
        for w in candidates:
            # A prefix a request in flight is computing is on that device before its events say so.
            ahead = self.active.held_depth(w, seq, now)
            if ahead > overlaps.get(w, NO_OVERLAP).device:
                overlaps[w] = on_device(overlaps.get(w, NO_OVERLAP), ahead)
            loads[w] = replace(self.loads.get(w, IDLE), potential_decode_blocks=self.active.decode_blocks(w, seq))
        endpoints = {w: p.control for w, p in self.publishers.items() if p.control and w in candidates}
        roles = {w: p.role for w, p in self.publishers.items()}
        models = {w: self.model_of(w) for w in candidates}
        pullable = pullable_blocks(candidates, overlaps, endpoints, roles)
        choice = choose(self.model, candidates, overlaps, loads, max(1, len(seq)), self.block_size, self.rng,
                        models=models, pullable=pullable)
        if pinned is not None:
            choice = Choice(pinned, choice.costs[pinned], overlaps.get(pinned, Overlap()), choice.costs)
        hint = choose_source(self.index, choice.worker, seq, overlaps, endpoints, roles)
        return Route(choice, hint, len(seq), overlaps, tuple(seq), loads, len(hinted_hashes(hint)), pullable)

    def model_of(self, worker: Worker) -> CostModel:
        """The weights `worker` is scored with: its measured ones, or as configured."""
        return self.rates.model(worker) if self.measure_costs else self.model

    def measured(self, route: Route, seconds: float, *, hinted: bool) -> None:
        """A request routed by `route` answered its first byte after `seconds` (a worker that left
        meanwhile is not measured again)."""
        if self.measure_costs and route.choice.worker in self.publishers:
            self.rates.add(route.choice.worker, route.sample(seconds, hinted=hinted))

    def close(self) -> None:
        self.subscriber.close()
