"""Prometheus metrics, read from the runner's statistics at scrape time (nothing counts twice)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from .runner import RunnerStatistics


class RunnerCollector:
    def __init__(self, service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        runner, pub, ctl = svc.runner, svc.publisher, svc.control
        pages = GaugeMetricFamily("kvcr_pages", "Pages by pool, tier and residency state",
                                  labels=["pool", "tier", "state"])
        nbytes = GaugeMetricFamily("kvcr_bytes", "Bytes of ready pages by pool and tier", labels=["pool", "tier"])
        capacity = GaugeMetricFamily("kvcr_capacity_pages", "Slots per pool", labels=["pool", "tier"])
        evictions = CounterMetricFamily("kvcr_evictions", "Pages evicted for room", labels=["pool", "tier"])
        stats = runner.statistics()
        for t in stats.tiers:
            s = t.dram
            for state, n in (("free", s.num_free), ("filling", s.num_filling), ("ready", s.num_ready),
                             ("discarding", s.num_discarding), ("claimed", s.num_claimed),
                             ("quarantined", s.num_quarantined), ("dirty", s.num_dirty)):
                pages.add_metric([s.name, "dram", state], n)
            nbytes.add_metric([s.name, "dram"], s.num_ready * s.page_bytes)
            capacity.add_metric([s.name, "dram"], s.capacity)
            evictions.add_metric([s.name, "dram"], t.evicted)
            if t.nvme is not None:
                d = t.nvme
                pages.add_metric([s.name, "nvme", "ready"], d.num_pages)
                pages.add_metric([s.name, "nvme", "writing"], d.num_writing)
                nbytes.add_metric([s.name, "nvme"], d.num_bytes)
                evictions.add_metric([s.name, "nvme"], d.num_evicted)
        yield from (pages, nbytes, capacity, evictions)
        yield from self._nvme(stats)
        yield from self._persist(stats)
        claim_stats = stats.claims
        yield CounterMetricFamily("kvcr_hits", "Pages found when claimed or read", value=stats.hits)
        yield CounterMetricFamily("kvcr_misses", "Pages asked for but absent", value=stats.misses)
        unheld = CounterMetricFamily("kvcr_hint_unheld_pages", "Pages a peer claimed from us (named by a hint or "
                                     "our stream) that we did not hold: never_held is a router's mistake, evicted "
                                     "an eviction race", labels=["cause"])
        unheld.add_metric(["never_held"], stats.unheld_never_held)
        unheld.add_metric(["evicted"], stats.unheld_evicted)
        yield unheld
        yield GaugeMetricFamily("kvcr_claims_held", "Claims currently pinning pages", value=claim_stats.num_claims)
        yield GaugeMetricFamily("kvcr_fills_held", "Fill reservations in progress", value=claim_stats.num_fills)
        yield CounterMetricFamily("kvcr_claims_expired", "Claims ended by lease expiry",
                                  value=claim_stats.num_expired_claims)
        yield CounterMetricFamily("kvcr_fills_expired", "Fill reservations ended by lease expiry",
                                  value=claim_stats.num_expired_fills)
        yield CounterMetricFamily("kvcr_event_batches", "Event batches published", value=pub.num_batches)
        yield CounterMetricFamily("kvcr_events", "Events published", value=pub.num_events)
        yield CounterMetricFamily("kvcr_event_batches_dropped", "Batches dropped on queue overflow (a gap)",
                                  value=pub.num_dropped)
        yield CounterMetricFamily("kvcr_replay_requests", "Replay requests served", value=pub.num_replay_requests)
        yield GaugeMetricFamily("kvcr_event_seq", "Last event seq assigned", value=pub.last_seq)
        relay = svc.relay
        if relay is not None:
            yield CounterMetricFamily("kvcr_engine_batches_relayed", "Engine batches republished",
                                      value=relay.num_relayed)
            yield CounterMetricFamily("kvcr_engine_problems", "Engine restarts, unrepaired gaps, wrong block sizes",
                                      value=relay.num_problems)
            yield CounterMetricFamily("kvcr_engine_malformed", "Malformed engine frames dropped",
                                      value=relay.num_malformed)
            yield GaugeMetricFamily("kvcr_engine_blocks", "Blocks the engine has announced (mirror)",
                                    value=len(relay.mirror.blocks))
        yield from self._peers(svc)
        yield CounterMetricFamily("kvcr_control_requests", "Control requests received", value=ctl.num_requests)
        yield CounterMetricFamily("kvcr_control_rejected", "Control requests refused with an error",
                                  value=ctl.num_rejected)
        yield CounterMetricFamily("kvcr_control_local_requests",
                                  "Control requests received over the same-host Unix socket (of all received)",
                                  value=ctl.num_local_requests)
        yield CounterMetricFamily("kvcr_control_local_refused",
                                  "Same-host control connections refused: another user's process",
                                  value=ctl.num_local_refused)
        yield CounterMetricFamily("kvcr_control_unauthenticated_refused",
                                  "Requests that read, write or address pages refused over the TCP socket of a "
                                  "runner without keys", value=ctl.num_refused_unauthenticated)


    @staticmethod
    def _nvme(stats: RunnerStatistics) -> Iterator[Metric]:
        nvme = stats.nvme
        if not nvme.disks:
            return
        corrupt = CounterMetricFamily("kvcr_nvme_corrupt", "Truncated or corrupt page files removed", labels=["pool"])
        unverified = GaugeMetricFamily("kvcr_nvme_unverified_pages",
                                       "Pages adopted without a digest (written by HiCacheFile)", labels=["pool"])
        foreign = GaugeMetricFamily("kvcr_nvme_foreign_files", "Files in the namespace directory that are not pages",
                                    labels=["pool"])
        errors = CounterMetricFamily("kvcr_nvme_errors", "Failed file operations by errno", labels=["pool", "errno"])
        latency = {op: HistogramMetricFamily(f"kvcr_nvme_{op}_seconds", f"Page {op} latency", labels=["pool"])
                   for op in ("read", "write")}
        for name, disk in nvme.disks:
            d = stats.tier(name).nvme
            corrupt.add_metric([name], d.num_corrupt)
            unverified.add_metric([name], d.num_unverified)
            foreign.add_metric([name], disk.foreign)
            for code, n in disk.errors:
                errors.add_metric([name, code], n)
            for op, (bounds, counts, total) in (("read", disk.read_latency), ("write", disk.write_latency)):
                cumulative, buckets = 0, []
                for bound, count in zip((*map(str, bounds), "+Inf"), counts):
                    cumulative += count
                    buckets.append((bound, cumulative))
                latency[op].add_metric([name], buckets, total)
        yield from (corrupt, unverified, foreign, errors, *latency.values())
        yield CounterMetricFamily("kvcr_spilled_pages", "DRAM pages written to NVMe (write-behind or spill)",
                                  value=nvme.spilled)
        yield CounterMetricFamily("kvcr_promoted_pages", "NVMe pages copied into DRAM to be served",
                                  value=nvme.promoted)


    @staticmethod
    def _persist(stats: RunnerStatistics) -> Iterator[Metric]:
        dropped = CounterMetricFamily("kvcr_pages_dropped", "Pages a tier let go that no tier below kept, by reason",
                                      labels=["pool", "tier", "reason"])
        queue = GaugeMetricFamily("kvcr_write_behind_queue", "Dirty pages waiting for the NVMe writer",
                                  labels=["pool"])
        lag = GaugeMetricFamily("kvcr_write_behind_lag_seconds", "Age of the oldest dirty page waiting (0: none)",
                                labels=["pool"])
        nvme = stats.nvme
        for (pool, tier, reason), n in stats.dropped:
            dropped.add_metric([pool, tier, reason], n)
        for t in stats.tiers:
            if t.nvme is not None:
                queue.add_metric([t.dram.name], t.write_behind_queue)
                lag.add_metric([t.dram.name], t.write_behind_lag_s)
        waits, waited, flush = nvme.fill_waits, nvme.fill_wait_s, nvme.shutdown_flush
        yield from (dropped, queue, lag)
        yield CounterMetricFamily("kvcr_nvme_writes_skipped", "Dirty pages already on NVMe (not rewritten)",
                                  value=nvme.skipped)
        refused = CounterMetricFamily("kvcr_nvme_writes_refused", "Dirty pages NVMe did not take, by reason",
                                      labels=["reason"])
        for reason, n in nvme.refused:
            refused.add_metric([reason], n)
        yield refused
        yield CounterMetricFamily("kvcr_fill_waits", "Fills that waited for the NVMe writer (back-pressure)",
                                  value=waits)
        yield CounterMetricFamily("kvcr_fill_wait_seconds", "Time fills spent waiting for the NVMe writer",
                                  value=waited)
        if flush is not None:
            yield GaugeMetricFamily("kvcr_shutdown_flush_seconds", "Time the shutdown flush to NVMe took",
                                    value=flush[0])

    @staticmethod
    def _peers(svc) -> Iterator[Metric]:
        plane = svc.plane
        if plane is None:
            return
        pulls = svc.pulls.statistics()
        yield GaugeMetricFamily("kvcr_ucx_registered_bytes", "DRAM bytes registered for peers' GETs",
                                value=plane.registered_bytes)
        yield GaugeMetricFamily("kvcr_ucx_registration_seconds", "Time the region registration took",
                                value=plane.registration_seconds)
        yield CounterMetricFamily("kvcr_pulled_pages", "Pages peers delivered (into DRAM, or an engine's host pages)",
                                  value=pulls.pulled)
        yield CounterMetricFamily("kvcr_pulled_inline_pages",
                                  "Of the pulled pages, those that came in the claim's answer (small pulls, no GETs)",
                                  value=pulls.inline)
        yield CounterMetricFamily("kvcr_ucx_workers_retired",
                                  "Pull workers destroyed after a transfer that did not end in time",
                                  value=plane.num_retired_workers)
        yield CounterMetricFamily("kvcr_pull_uncertain_pages", "Slots quarantined after an uncertain pull",
                                  value=pulls.uncertain)
        yield CounterMetricFamily("kvcr_pull_digest_mismatches", "Pulled pages whose bytes missed their digest",
                                  value=pulls.digest_mismatches)
        yield CounterMetricFamily("kvcr_peer_unreachable", "Claims or info requests a peer did not answer",
                                  value=pulls.unreachable)
        yield CounterMetricFamily("kvcr_peer_skipped_unreachable",
                                  "Pulls not tried: the source had not answered lately (backing off)",
                                  value=pulls.skipped_unreachable)
        yield CounterMetricFamily("kvcr_peer_recovered",
                                  "Back-offs ended early: a background probe found the source answering again",
                                  value=pulls.recovered)
        yield CounterMetricFamily("kvcr_pull_untrusted_refused", "Pulls refused: the source is not a trusted peer",
                                  value=pulls.refused_untrusted)
        yield CounterMetricFamily("kvcr_control_unauthenticated",
                                  "CURVE clients refused (control, events and replay sockets)",
                                  value=svc.gate.num_unauthenticated if svc.gate is not None else 0)
        yield CounterMetricFamily("kvcr_http_unauthorized", "/info requests refused for want of the token",
                                  value=svc.http.num_unauthorized)
        yield GaugeMetricFamily("kvcr_hinted_hashes", "Block hashes held from posted hints", value=pulls.hinted_hashes)


def make_registry(service) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunnerCollector(service))
    return registry
