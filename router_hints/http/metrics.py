"""The router's Prometheus metrics: counters its request path bumps, gauges read from the core."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..breaker import Breakers
from ..core import RouterCore
from ..index import Worker
from ..rates import tier_weights


class RouterMetrics:
    def __init__(self, core: RouterCore, breakers: Breakers, costs: "MeasuredCosts") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter("kvcr_router_decisions", "Requests routed, by target worker and route",
                                 ["worker", "route"], registry=r)
        self.overlap = Counter("kvcr_router_overlap_blocks", "Cached blocks of the chosen target, by tier "
                               "(device, host, dram, disk; runner: the leading blocks its runner holds)",
                               ["tier"], registry=r)
        self.hints = Counter("kvcr_router_hints", "Source hints: issued, posted to the target runner, attached to "
                             "the body, failed to post", ["outcome"], registry=r)
        self.stripped = Counter("kvcr_router_client_hints_stripped", "Hints clients put in requests (removed)",
                                registry=r)
        self.upstream_errors = Counter("kvcr_router_upstream_errors", "Requests a worker failed", ["worker"],
                                       registry=r)
        self.retries = Counter("kvcr_router_retries", "Requests sent to another worker after this one failed before "
                               "its first byte", ["worker"], registry=r)
        self.failed = Counter("kvcr_router_failed_requests", "Requests answered 502/503: every try failed or no "
                              "worker was left", ["route"], registry=r)
        self.breaker_trips = Counter("kvcr_router_breaker_trips", "Times a worker was taken out of routing for "
                                     "failing requests", ["worker"], registry=r)
        self.health_checks = Counter("kvcr_router_health_checks", "Health checks of workers out of routing or "
                                     "silent, by outcome", ["worker", "outcome"], registry=r)
        Gauge("kvcr_router_workers_failing", "Workers out of routing until their health check passes",
              registry=r).set_function(lambda: len(breakers.open))
        self.route_seconds = Histogram("kvcr_router_route_seconds", "Tokenize + hash + score + hint time",
                                       buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0), registry=r)
        Gauge("kvcr_router_index_blocks", "Blocks held in the index (all workers and tiers)",
              registry=r).set_function(lambda: core.index.num_blocks())
        Gauge("kvcr_router_event_lag_seconds", "Publish-to-apply delay of the latest event batch",
              registry=r).set_function(lambda: core.event_lag_s)
        Gauge("kvcr_router_event_batches", "Event batches applied", registry=r).set_function(
            lambda: core.num_batches)
        Gauge("kvcr_router_event_gaps", "Gaps seen in workers' event streams", registry=r).set_function(
            lambda: core.num_gaps)
        Gauge("kvcr_router_batches_replayed", "Batches a gap's replay delivered", registry=r).set_function(
            lambda: core.num_replayed)
        Gauge("kvcr_router_snapshots_loaded", "Inventory snapshots loaded (a join, an unrepaired gap, a return)",
              registry=r).set_function(lambda: core.num_snapshots)
        Gauge("kvcr_router_malformed_frames", "Event frames skipped as malformed", registry=r).set_function(
            lambda: core.subscriber.num_malformed)
        self.inflight = Gauge("kvcr_router_inflight", "Requests in flight, by worker", ["worker"], registry=r)
        Gauge("kvcr_router_workers_down", "Workers whose event stream went silent (not routed to)",
              registry=r).set_function(lambda: len(core.liveness.dead))
        Gauge("kvcr_router_workers", "Workers known (live or down)", registry=r).set_function(
            lambda: len(core.publishers))
        r.register(costs)


class MeasuredCosts:
    """Prometheus: each worker's measured seconds per block and the tier weights it is scored with."""

    def __init__(self, core: RouterCore, measure_costs: bool, worker_name: Callable[[Worker], str]) -> None:
        self.core = core
        self.measure_costs = measure_costs
        self.worker_name = worker_name

    def describe(self):
        return []

    def collect(self):
        per = GaugeMetricFamily("kvcr_router_seconds_per_block", "Measured seconds to first byte a block adds, "
                                "by worker and kind (computed, or held at a tier)",
                                labels=["worker", "dp_rank", "kind"])
        weight = GaugeMetricFamily("kvcr_router_tier_weight", "Share of a recompute a block held at a tier "
                                   "saves, as the worker is scored (source: measured, or configured)",
                                   labels=["worker", "dp_rank", "tier", "source"])
        samples = CounterMetricFamily("kvcr_router_cost_samples", "Streamed requests whose first byte was timed "
                                      "for the measured costs", labels=["worker", "dp_rank"])
        for worker, rates in sorted(self.core.rates.workers.items()):
            # a DP engine's ranks share its name: the rank keeps their series apart
            name, rank = self.worker_name(worker), str(worker[1])
            samples.add_metric([name, rank], rates.samples)
            for kind, seconds in rates.seconds_per_block.items():
                per.add_metric([name, rank, kind], seconds)
            measured = rates.measured if self.measure_costs else {}
            for tier, w in tier_weights(self.core.model_of(worker)).items():
                weight.add_metric([name, rank, tier, "measured" if tier in measured else "configured"], w)
        yield per
        yield weight
        yield samples
