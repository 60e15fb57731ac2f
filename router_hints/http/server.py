"""`kvcr router`: hash each request's pages, pick the cheapest worker from the live index and
load, name a peer to pull the rest from, and forward the request unchanged but for the hint."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvcr.client import fetch_info
from kvcr.config import CurveKeys
from kvcr.curve_keys import client_http_token
from kvcr.client import ControlClient, ControlError
from kvcr.proto import messages as m

from ..breaker import Breakers
from ..core import Route, RouterCore
from ..discovery import DiscoveryError, from_runner_info
from ..index import NO_OVERLAP, Worker
from ..rates import tier_weights
from ..scoring import Load
from kvcr.text import RequestError, TextTokenizer, request_cache_salt, request_tokens
from . import front
from .config import RouterConfig, RouterConfigError, WorkerEntry, load_router_config, parse_worker
from .dynamo_discovery import entries_from_cards, fetch_cards

log = logging.getLogger(__name__)
PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
# What every worker answers alike: asked of one routable worker (the next, if it fails).
ANY_WORKER_GETS = ("/v1/models", "/v1/models/{model:.+}", "/model_info", "/get_model_info", "/server_info",
                   "/get_server_info")
RETRYABLE_STATUS = frozenset({502, 503, 504})  # the worker (or a proxy before it) could not serve it
HEALTH_TIMEOUT_S = 2.0
DISCOVERY_TIMEOUT_S = 10.0  # one try at a worker's /server_info: a hung worker must not hold the health checks
FLUSH_TIMEOUT_S = 120.0  # SGLang's flush waits for running requests up to its `timeout`; ours waits a bit more


@dataclass(frozen=True, slots=True)
class Failed:
    """A worker failed a request before the answer's first byte: it may still go elsewhere."""

    reason: str
    refused: bool  # nothing listened: the worker is gone or restarting
    answer: tuple[int, str, bytes] | None = None  # the worker's own answer (status, content type, body), if any
    # A worker silent for request_timeout_s is failing, but the request may just be long: running
    # it again elsewhere could keep the client waiting that long once more per retry.
    retry: bool = True


class RouterMetrics:
    def __init__(self, app: "Router") -> None:
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
              registry=r).set_function(lambda: len(app.breakers.open))
        self.route_seconds = Histogram("kvcr_router_route_seconds", "Tokenize + hash + score + hint time",
                                       buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0), registry=r)
        Gauge("kvcr_router_index_blocks", "Blocks held in the index (all workers and tiers)",
              registry=r).set_function(lambda: app.core.index.num_blocks())
        Gauge("kvcr_router_event_lag_seconds", "Publish-to-apply delay of the latest event batch",
              registry=r).set_function(lambda: app.core.event_lag_s)
        Gauge("kvcr_router_event_batches", "Event batches applied", registry=r).set_function(
            lambda: app.core.num_batches)
        Gauge("kvcr_router_event_gaps", "Gaps seen in workers' event streams", registry=r).set_function(
            lambda: app.core.num_gaps)
        Gauge("kvcr_router_batches_replayed", "Batches a gap's replay delivered", registry=r).set_function(
            lambda: app.core.num_replayed)
        Gauge("kvcr_router_snapshots_loaded", "Inventory snapshots loaded (a join, an unrepaired gap, a return)",
              registry=r).set_function(lambda: app.core.num_snapshots)
        Gauge("kvcr_router_malformed_frames", "Event frames skipped as malformed", registry=r).set_function(
            lambda: app.core.subscriber.num_malformed)
        self.inflight = Gauge("kvcr_router_inflight", "Requests in flight, by worker", ["worker"], registry=r)
        Gauge("kvcr_router_workers_down", "Workers whose event stream went silent (not routed to)",
              registry=r).set_function(lambda: len(app.core.liveness.dead))
        Gauge("kvcr_router_workers", "Workers known (live or down)", registry=r).set_function(
            lambda: len(app.core.publishers))
        r.register(MeasuredCosts(app))


class MeasuredCosts:
    """Prometheus: each worker's measured seconds per block and the tier weights it is scored with."""

    def __init__(self, app: "Router") -> None:
        self.app = app

    def describe(self):
        return []

    def collect(self):
        per = GaugeMetricFamily("kvcr_router_seconds_per_block", "Measured seconds to first byte a block adds, "
                                "by worker and kind (computed, or held at a tier)", labels=["worker", "kind"])
        weight = GaugeMetricFamily("kvcr_router_tier_weight", "Share of a recompute a block held at a tier "
                                   "saves, as the worker is scored (source: measured, or configured)",
                                   labels=["worker", "tier", "source"])
        samples = CounterMetricFamily("kvcr_router_cost_samples", "Streamed requests whose first byte was timed "
                                      "for the measured costs", labels=["worker"])
        for worker, rates in sorted(self.app.core.rates.workers.items()):
            name = self.app.worker_name(worker)
            samples.add_metric([name], rates.samples)
            for kind, seconds in rates.seconds_per_block.items():
                per.add_metric([name, kind], seconds)
            measured = rates.measured if self.app.cfg.measure_costs else {}
            for tier, w in tier_weights(self.app.core.model_of(worker)).items():
                weight.add_metric([name, tier, "measured" if tier in measured else "configured"], w)
        yield per
        yield weight
        yield samples


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.tokenizer = TextTokenizer(cfg.tokenizer or None)
        self.core = RouterCore(block_size=cfg.block_size, model=cfg.cost, dead_after_s=cfg.dead_after_s,
                               curve=CurveKeys.from_env(), measure_costs=cfg.measure_costs)
        self.entries: dict[Worker, WorkerEntry] = {}
        self.breakers = Breakers(cfg.breaker_failures)
        self.metrics = RouterMetrics(self)
        self._posting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcr-router-post")  # owns the sockets
        self._clients: dict[str, ControlClient] = {}
        self.session: aiohttp.ClientSession | None = None

    # --- discovery and events ------------------------------------------------------------------

    async def discover(self, entry: WorkerEntry, timeout_s: float = 120.0) -> None:
        """Find the worker's runner through info endpoints (retrying while it starts)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = await self._runner_info(entry)
                publisher = from_runner_info(entry.name, info, block_size=self.cfg.block_size, role=entry.role)
                break
            except (OSError, TimeoutError, aiohttp.ClientError, KeyError) as exc:
                if time.monotonic() > deadline:
                    raise DiscoveryError(f"worker {entry.name}: no runner info within {timeout_s:.0f} s: {exc}") \
                        from None
                await asyncio.sleep(0.5)
        self.core.add(publisher)
        worker = (publisher.worker_id, publisher.dp_rank)
        self.entries[worker] = entry
        await self.resync(worker)
        log.info("worker %s: events %s, control %s", entry.name, publisher.events, publisher.control)

    async def _runner_info(self, entry: WorkerEntry) -> dict:
        if entry.runner:
            return await asyncio.to_thread(fetch_info, entry.runner, token=entry.runner_token or client_http_token())
        async with self.session.get(entry.url.rstrip("/") + "/server_info",
                                    timeout=aiohttp.ClientTimeout(total=DISCOVERY_TIMEOUT_S)) as resp:
            resp.raise_for_status()
            info = await resp.json()
        if "kvcr_runner" not in info:
            raise DiscoveryError(f"worker {entry.name}: /server_info has no kvcr_runner; set its `runner` "
                                 "(the runner's http:// or tcp:// control endpoint)")
        return info["kvcr_runner"]

    async def resync(self, worker: Worker) -> None:
        """Load the runner's inventory snapshot (a router that joins late, or lost a gap)."""
        control = self.core.publishers[worker].control
        if not control:
            return  # an engine's own publisher: replay is all there is
        try:
            seq, events = await asyncio.to_thread(_snapshot, control)
        except (TimeoutError, ControlError, OSError) as exc:
            log.warning("snapshot of %s failed (retried later): %s", worker[0], exc)
            self.core.needs_snapshot.add(worker)
            return
        self.core.load_snapshot(worker, seq, events)
        log.info("worker %s: inventory loaded from its snapshot (%d events, seq %d)", worker[0], len(events), seq)

    async def follow_events(self) -> None:
        while True:
            try:
                n = self.core.poll(0)
                for worker in list(self.core.needs_snapshot):
                    await self.resync(worker)
            except Exception:  # one bad pass must not stop the index following the workers
                log.exception("following the event streams failed; going on")
                n = 0
            await asyncio.sleep(0 if n else 0.002)

    # --- routing ---------------------------------------------------------------------------------

    def decide(self, tokens: list[int], pinned: str | None = None, cache_salt: str | None = None,
               tried: frozenset[Worker] = frozenset()) -> Route:
        """Where a request goes; workers whose requests fail (breaker open) and those this request
        already failed on (`tried`) are left out, unless pinned."""
        start = time.perf_counter()
        self.core.poll(0)  # whatever arrived since the last tick
        worker = None
        if pinned is not None:
            worker = next((w for w, e in self.entries.items() if e.name == pinned), None)
            if worker is None:
                raise RequestError(f"X-KVCR-Target names no worker: {pinned!r}")
        decision = self.core.route(tokens, pinned=worker, cache_salt=cache_salt, excluded=tried | self.breakers.open)
        self.metrics.route_seconds.observe(time.perf_counter() - start)
        return decision

    def _post(self, endpoint: str, envelope: dict) -> None:
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = ControlClient(endpoint, timeout_s=2.0)
        try:
            client.request(m.PostHint(envelope=envelope))
        except (TimeoutError, OSError):
            # Its same-host socket belongs to one incarnation of the runner: the next hint reconnects.
            self._clients.pop(endpoint).close()
            raise

    async def post_hint(self, worker: Worker, envelope: dict) -> bool:
        """Whether the worker's runner took the hint."""
        control = self.core.publishers[worker].control
        try:
            await asyncio.get_running_loop().run_in_executor(self._posting, self._post, control, envelope)
            self.metrics.hints.labels("posted").inc()
            return True
        except (TimeoutError, ControlError, OSError) as exc:
            # The request still runs; it computes what a pull would have brought.
            self.metrics.hints.labels("post_failed").inc()
            log.warning("posting a hint to %s failed: %s", control, exc)
            return False

    def debug_view(self, tokens: list[int], cache_salt: str | None = None) -> dict:
        decision = self.decide(tokens, cache_salt=cache_salt)
        rows = []
        for w in self.core.alive():
            o = decision.overlaps.get(w, NO_OVERLAP)
            # "overlap" sums to the depth; "runner" overlaps it: the leading blocks a hint may name
            rows.append({"worker": w[0], "dp_rank": w[1],
                         "overlap": {"device": o.device, "host": o.host, "dram": o.dram, "disk": o.disk},
                         "runner": o.runner,
                         "load": asdict(decision.loads.get(w, Load())), "cost": decision.choice.costs[w],
                         "pullable": decision.pullable.get(w, 0),
                         "weights": tier_weights(self.core.model_of(w))})
        return {"tokens": len(tokens), "block_size": self.cfg.block_size, "request_blocks": decision.request_blocks,
                "cost_model": asdict(self.cfg.cost), "measured_costs": self.cfg.measure_costs, "workers": rows,
                "choice": {"worker": decision.choice.worker[0], "dp_rank": decision.choice.worker[1],
                           "cost": decision.choice.cost},
                "hint": decision.hint, "index_blocks": self.core.index.num_blocks()}

    # --- HTTP -----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.add_routes([*(web.post(path, self._handler(route)) for route, path in PATHS.items()),
                        *(web.get(path, self.to_any_worker) for path in ANY_WORKER_GETS),
                        web.get("/flush_cache", self.flush_cache), web.post("/flush_cache", self.flush_cache),
                        web.get("/health_generate", self.health_generate),
                        web.post("/debug/index", self.debug_index), web.get("/metrics", self.metrics_page),
                        web.get("/health", self.health), web.get("/workers", self.workers),
                        web.post("/admin/workers", self.admin_add), web.delete("/admin/workers/{name}", self.admin_remove)])
        return app

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    def operator_refusal(self, request: web.Request) -> str:
        """Why an operator-only request (a pinned target, the index view, membership) is refused; "" if allowed.
        Without router.operator_token only a router bound to loopback serves them."""
        token = self.cfg.operator_token
        if not token:
            return "" if self.cfg.host in ("127.0.0.1", "localhost", "::1") else \
                "this needs router.operator_token: the router is reachable from other hosts"
        given = request.headers.get("Authorization", "").encode()
        return "" if hmac.compare_digest(given, f"Bearer {token}".encode()) else \
            "this needs the operator token: Authorization: Bearer <router.operator_token>"

    def _handler(self, route: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            refusal = self.operator_refusal(request) if "X-KVCR-Target" in request.headers else ""
            if refusal:
                return web.json_response({"error": {"message": f"X-KVCR-Target: {refusal}"}}, status=403)
            pinned = request.headers.get("X-KVCR-Target")
            try:
                body, removed = front.strip_client_hints(await self._body(request))
                tokens = request_tokens(body, route, self.tokenizer)
                salt = request_cache_salt(body)
                decision = self.decide(tokens, pinned, salt)
            except RequestError as exc:
                return web.json_response({"error": {"message": str(exc)}}, status=400)
            except LookupError as exc:  # every worker (or the pinned one) is down
                self.metrics.failed.labels(route).inc()
                return web.json_response({"error": {"message": str(exc)}}, status=503)
            self.metrics.stripped.inc(removed)
            return await self._forward(request, route, body, tokens, decision, salt, retry=pinned is None)
        return handle

    async def _forward(self, request: web.Request, route: str, body: dict, tokens: list[int], decision: Route,
                       salt: str | None, *, retry: bool) -> web.StreamResponse:
        """Send it to the decision's worker; one that fails before the answer's first byte costs a
        retry on the next best (bounded, with back-off), never a retry once bytes reached the client."""
        tried: set[Worker] = set()
        failures: list[str] = []
        last: Failed | None = None
        failed_on = ""
        for attempt in range(1 + (self.cfg.max_retries if retry else 0)):
            if attempt:
                if last is not None and not last.retry:
                    break
                await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 1))
                try:
                    decision = self.decide(tokens, cache_salt=salt, tried=frozenset(tried))
                except LookupError as exc:
                    failures.append(str(exc))
                    break
                self.metrics.retries.labels(failed_on).inc()
            target = decision.choice.worker
            outcome = await self._attempt(request, route, body, tokens, decision)
            if not isinstance(outcome, Failed):
                self.breakers.succeeded(target)
                return outcome
            tried.add(target)
            failed_on = self.worker_name(target)
            failures.append(f"worker {failed_on}: {outcome.reason}")
            self._count_failure(target, failed_on, outcome)
            last = outcome
        self.metrics.failed.labels(route).inc()
        if last is not None and last.answer is not None:  # the last worker's own refusal, as it gave it
            status, content_type, raw = last.answer
            return web.Response(status=status, body=raw, headers={"Content-Type": content_type})
        return web.json_response({"error": {"message": "; ".join(failures)}}, status=502)

    def worker_name(self, worker: Worker) -> str:
        entry = self.entries.get(worker)  # it may have left while its request ran
        return entry.name if entry is not None else worker[0]

    def _count_failure(self, target: Worker, name: str, outcome: Failed) -> None:
        self.metrics.upstream_errors.labels(name).inc()
        if self.breakers.failed(target, refused=outcome.refused):
            self.metrics.breaker_trips.labels(name).inc()
            log.warning("worker %s taken out of routing until its health check passes: %s", name, outcome.reason)

    async def _attempt(self, request: web.Request, route: str, body: dict, tokens: list[int], decision: Route
                       ) -> web.StreamResponse | Failed:
        target = decision.choice.worker
        entry = self.entries[target]
        self._count(route, decision)
        source_depth = decision.hint_blocks
        booking = front.Booking(target, len(tokens),
                                max(0, decision.request_blocks - max(decision.choice.overlap.depth, source_depth)),
                                decision.request_blocks)
        front.book(self.core.loads, booking)  # before any await: concurrent requests see this load
        self.core.active.start(target, list(decision.seq_hashes))
        self.metrics.inflight.labels(entry.name).inc()
        served = False
        try:
            hinted = False
            if decision.hint is not None:
                body, hinted = await self._issue_hint(route, target, body, decision.hint)
            outcome = await self._relay(request, entry, route, body, booking, decision, hinted)
            served = not isinstance(outcome, Failed)
            return outcome
        finally:
            front.finished(self.core.loads, booking)
            self.core.active.finish(target, list(decision.seq_hashes), self.core.clock(), computed=served)
            self.metrics.inflight.labels(entry.name).dec()

    async def _issue_hint(self, route: str, target: Worker, body: dict, hint: dict) -> tuple[dict, bool]:
        """The body to send, and whether the hint reached the worker (posted, or in the body)."""
        self.metrics.hints.labels("issued").inc()
        posted = await self.post_hint(target, hint) if self.cfg.post_hints else False
        if self.cfg.attach_hints and route == "generate":
            self.metrics.hints.labels("attached").inc()
            return front.attach_hint(body, hint), True
        return body, posted

    async def _relay(self, request: web.Request, entry: WorkerEntry, route: str, body: dict,
                     booking: front.Booking, decision: Route, hinted: bool) -> web.StreamResponse | Failed:
        """Forward the body; stream the answer back as it comes (a long generation has no total
        deadline, only one per read). Nothing reaches the client before the worker's first byte,
        so a failure until then is a `Failed` the caller may retry elsewhere."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.cfg.request_timeout_s)
        headers = _auth(request)
        resp: web.StreamResponse | None = None
        sent = time.monotonic()
        try:
            async with self.session.post(entry.url.rstrip("/") + PATHS[route], json=body, timeout=timeout,
                                         headers=headers) as up:
                if up.status in RETRYABLE_STATUS:
                    raw = await up.read()
                    return Failed(f"answered {up.status}: {raw[:200]!r}", refused=False,
                                  answer=(up.status, up.headers.get("Content-Type", "text/plain"), raw))
                chunk = await up.content.readany()
                # A stream's first bytes are its first token: what this worker's blocks cost (an
                # error event is no token).
                first_byte_s = (time.monotonic() - sent if body.get("stream") is True and up.status == 200
                                and chunk and b'"error"' not in chunk[:64] else None)
                resp = web.StreamResponse(status=up.status, headers={
                    "Content-Type": up.headers.get("Content-Type", "application/json"), "X-KVCR-Worker": entry.name})
                try:
                    await resp.prepare(request)
                    while chunk:
                        if not booking.prefilled:
                            front.prefill_done(self.core.loads, booking)
                        await resp.write(chunk)
                        if first_byte_s is not None:  # the client has its token before the fit runs
                            self.core.measured(decision, first_byte_s, hinted=hinted)
                            first_byte_s = None
                        chunk = await up.content.readany()
                    await resp.write_eof()
                except ConnectionError as exc:
                    # Writing to a client that left raises ConnectionError (or aiohttp's
                    # ClientConnectionResetError, also a ClientError): not the worker's failure.
                    if request.transport is not None and not request.transport.is_closing():
                        raise
                    # Leaving `async with` closes the upstream connection: the worker aborts the request.
                    log.info("the client of a %s request on %s left mid-answer: %r", route, entry.name, exc)
                return resp
        except aiohttp.ClientConnectorError as exc:
            return Failed(f"connection refused: {exc}", refused=True)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if resp is None:
                timed_out = isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError))
                return Failed(f"failed before answering: {exc!r}", refused=False, retry=not timed_out,
                              answer=(504, "text/plain", f"worker {entry.name} sent nothing within "
                                                         f"{self.cfg.request_timeout_s:.0f} s\n".encode())
                              if timed_out else None)
            self.metrics.upstream_errors.labels(entry.name).inc()  # the answer has started: it can only be cut short
            log.warning("worker %s failed mid-answer: %r", entry.name, exc)
            return resp

    def _count(self, route: str, decision: Route) -> None:
        self.metrics.decisions.labels(self.entries[decision.choice.worker].name, route).inc()
        o = decision.choice.overlap
        for tier, n in (("device", o.device), ("host", o.host), ("dram", o.dram), ("disk", o.disk),
                        ("runner", o.runner)):
            self.metrics.overlap.labels(tier).inc(n)

    async def debug_index(self, request: web.Request) -> web.Response:
        refusal = self.operator_refusal(request)
        if refusal:
            return web.json_response({"error": {"message": f"/debug/index: {refusal}"}}, status=403)
        route = request.query.get("route", "generate")
        if route not in PATHS:
            return web.json_response({"error": {"message": f"route must be one of {sorted(PATHS)}"}}, status=400)
        try:
            body = await self._body(request)
            tokens = request_tokens(body, route, self.tokenizer)
            salt = request_cache_salt(body)
        except RequestError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        try:
            return web.json_response(self.debug_view(tokens, salt))
        except LookupError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    # --- what SGLang's and OpenAI's clients ask besides requests ---------------------------------

    def routable(self) -> list[Worker]:
        """Workers that take requests now: events alive, breaker closed (in a stable order)."""
        return [w for w in self.core.alive() if not self.breakers.is_open(w) and w in self.entries]

    async def to_any_worker(self, request: web.Request) -> web.Response:
        """The model list, model and server info: every worker answers them alike, so the first
        routable worker that answers does (sglang-router asks its first worker too)."""
        problems = []
        for worker in self.routable():
            entry = self.entries[worker]
            try:
                async with self.session.get(entry.url.rstrip("/") + request.path_qs, headers=_auth(request),
                                            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)) as up:
                    if up.status in RETRYABLE_STATUS:
                        problems.append(f"{entry.name}: {up.status}")
                        continue
                    return web.Response(body=await up.read(), status=up.status, headers={
                        "Content-Type": up.headers.get("Content-Type", "application/json"), "X-KVCR-Worker": entry.name})
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                problems.append(f"{entry.name}: {exc!r}")
        message = f"no worker answered {request.path}: {'; '.join(problems)}" if problems else "no routable worker"
        return web.json_response({"error": {"message": message}}, status=503)

    async def _ask_every_worker(self, request: web.Request, method: str, path: str, timeout_s: float,
                                workers: list[Worker]) -> list[tuple[str, int, str]]:
        """(worker name, status, body) from each of `workers` at once; status 0: no answer."""
        async def ask(entry: WorkerEntry) -> tuple[str, int, str]:
            try:
                async with self.session.request(method, entry.url.rstrip("/") + path, headers=_auth(request),
                                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as up:
                    return entry.name, up.status, (await up.text()).strip()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return entry.name, 0, repr(exc)
        return list(await asyncio.gather(*(ask(self.entries[w]) for w in workers)))

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Every worker's cache, as SGLang's flush_cache: 200 when every worker flushed; 400, as
        SGLang answers, when one refused because requests still run; else 502 (one did not answer)."""
        refusal = self.operator_refusal(request)
        if refusal:  # it empties every worker's cache
            return web.json_response({"error": {"message": f"/flush_cache: {refusal}"}}, status=403)
        answers = await self._ask_every_worker(request, "POST", request.path_qs, FLUSH_TIMEOUT_S, list(self.entries))
        lines = "".join(f"{name}: {status or 'no answer'} {text}\n" for name, status, text in answers)
        if all(status == 200 for _, status, _ in answers):
            return web.Response(text=f"Cache flushed on all {len(answers)} workers.\n{lines}")
        status = 400 if any(status == 400 for _, status, _ in answers) else 502
        return web.Response(status=status, text=f"Cache not flushed on every worker.\n{lines}")

    async def health_generate(self, request: web.Request) -> web.Response:
        """Healthy when a routable worker generates (SGLang's /health_generate on each, at once)."""
        answers = await self._ask_every_worker(request, "GET", "/health_generate", self.cfg.request_timeout_s,
                                               self.routable())
        lines = "".join(f"{name}: {status or 'no answer'}\n" for name, status, _ in answers)
        ok = any(status == 200 for _, status, _ in answers)
        return web.Response(status=200 if ok else 503, text=lines or "no routable worker\n")

    # --- taking failing workers out, and back ----------------------------------------------------

    async def check_health(self) -> None:
        """Workers out of routing (breaker open) or silent (events stopped) are health-checked every
        health_interval_s; one that passes is routed to again, its runner found again if it moved."""
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            suspects = [w for w in list(self.entries) if self.breakers.is_open(w) or self.core.liveness.is_dead(w)]
            try:
                await asyncio.gather(*(self._check(w) for w in suspects))
            except Exception:  # one bad pass must not stop the checks
                log.exception("health checks failed; going on")

    async def _check(self, worker: Worker) -> None:
        entry = self.entries.get(worker)
        if entry is None:
            return
        try:
            async with self.session.get(entry.url.rstrip("/") + "/health",
                                        timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as up:
                passed = up.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            passed = False
        self.metrics.health_checks.labels(entry.name, "passed" if passed else "failed").inc()
        if not passed:
            return
        if self.core.liveness.is_dead(worker):
            await self._find_again(worker, entry)
        if self.breakers.health_passed(worker):
            log.info("worker %s passed its health check: routed to again", entry.name)

    async def _find_again(self, worker: Worker, entry: WorkerEntry) -> None:
        """A restarted worker's runner may publish elsewhere now: follow its new endpoints."""
        try:
            info = await self._runner_info(entry)
            publisher = from_runner_info(entry.name, info, block_size=self.cfg.block_size, role=entry.role)
        except (OSError, TimeoutError, aiohttp.ClientError, KeyError, DiscoveryError) as exc:
            log.info("worker %s answers but its runner does not (yet): %s", entry.name, exc)
            return
        if self.entries.get(worker) is not entry:  # it left (or was replaced) while we asked
            return
        known = self.core.publishers.get(worker)
        if known is None or (publisher.worker_id, publisher.dp_rank) != worker or \
                (known.events, known.replay, known.control) == (publisher.events, publisher.replay, publisher.control):
            return  # same endpoints: its next batch revives it
        try:
            self.core.moved(publisher)
        except DiscoveryError as exc:
            log.warning("worker %s: its moved runner cannot be followed: %s", entry.name, exc)
            return
        await self.resync(worker)
        log.info("worker %s: its runner moved; following events %s, control %s", entry.name, publisher.events,
                 publisher.control)

    async def workers(self, request: web.Request) -> web.Response:
        return web.json_response([{"name": e.name, "url": e.url, "dp_rank": w[1], "alive": not self.core.liveness.is_dead(w),
                                   "events": self.core.publishers[w].events, "control": self.core.publishers[w].control,
                                   "load": asdict(self.core.loads.get(w, Load()))} for w, e in self.entries.items()])

    # --- membership: an operator adds and removes workers at run time ----------------------------

    async def watch(self, source: Callable[[], dict[str, WorkerEntry]], where: str, period_s: float = 1.0) -> None:
        """Membership from a discovery source (key -> worker entry, read in a thread): a worker
        whose key appears joins, one whose key goes leaves. A source that cannot be read keeps
        what it gave before (its workers' own liveness still applies)."""
        joined: dict[str, str] = {}
        while True:
            try:
                seen = await asyncio.to_thread(source)
            except DiscoveryError as exc:
                log.warning("%s not read (membership unchanged): %s", where, exc)
                seen = None
            if seen is not None:
                for key, entry in seen.items():
                    if key not in joined and not any(e.name == entry.name for e in self.entries.values()):
                        joined[key] = entry.name
                        asyncio.create_task(self._join(entry, where))
                for key in [k for k in joined if k not in seen]:
                    self._leave(joined.pop(key))
            await asyncio.sleep(period_s)

    def discovery_sources(self) -> list[tuple[Callable[[], dict[str, WorkerEntry]], str]]:
        """The sources membership follows, each with what to call it in the log."""
        sources = []
        if self.cfg.discovery_dir:
            sources.append((self.directory_entries, self.cfg.discovery_dir))
        if self.cfg.dynamo_discovery:
            sources.append((self.dynamo_entries, f"Dynamo's etcd {self.cfg.dynamo_discovery}"))
        return sources

    def directory_entries(self) -> dict[str, WorkerEntry]:
        """router.discovery_dir: the info files `kvcr worker --info-file` wrote there."""
        found = ((str(p), _entry_from_info_file(p)) for p in Path(self.cfg.discovery_dir).glob("*.json"))
        return {key: entry for key, entry in found if entry is not None}

    def dynamo_entries(self) -> dict[str, WorkerEntry]:
        """router.dynamo_discovery: the kvcr workers registered in Dynamo's etcd."""
        entries, problems = entries_from_cards(fetch_cards(self.cfg.dynamo_discovery, self.cfg.dynamo_namespace))
        for problem in problems:
            log.warning("Dynamo's discovery: worker skipped: %s", problem)
        return entries

    async def _join(self, entry: WorkerEntry, where: str) -> None:
        try:
            await self.discover(entry, timeout_s=30.0)
        except DiscoveryError as exc:
            log.warning("worker %s from %s not joined: %s", entry.name, where, exc)

    def _leave(self, name: str) -> None:
        gone = [w for w, e in self.entries.items() if e.name == name]
        self.core.remove(name)
        for worker in gone:
            del self.entries[worker]
            self.breakers.forget(worker)
        log.info("worker %s left the routing", name)

    async def admin_add(self, request: web.Request) -> web.Response:
        refusal = self.operator_refusal(request)
        if refusal:
            return web.json_response({"error": {"message": f"/admin/workers: {refusal}"}}, status=403)
        try:
            entry = parse_worker(await self._body(request))
        except (RequestError, RouterConfigError) as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if any(e.name == entry.name for e in self.entries.values()):
            return web.json_response({"error": {"message": f"worker {entry.name!r} is already routed to"}},
                                     status=409)
        try:
            await self.discover(entry, timeout_s=10.0)
        except DiscoveryError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=502)
        return web.json_response({"added": entry.name})

    async def admin_remove(self, request: web.Request) -> web.Response:
        refusal = self.operator_refusal(request)
        if refusal:
            return web.json_response({"error": {"message": f"/admin/workers: {refusal}"}}, status=403)
        name = request.match_info["name"]
        if not any(e.name == name for e in self.entries.values()):
            return web.json_response({"error": {"message": f"no worker named {name!r}"}}, status=404)
        self._leave(name)
        return web.json_response({"removed": name})

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        self._posting.submit(lambda: [c.close() for c in self._clients.values()]).result()
        self._posting.shutdown()
        self.core.close()


def _auth(request: web.Request) -> dict[str, str]:
    """The client's credentials go to the worker as they came (SGLang's admin routes read them)."""
    return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}


def _entry_from_info_file(path: Path) -> WorkerEntry | None:
    """A `kvcr worker --info-file` file as a worker entry; None while it is partial or not one."""
    try:
        info = json.loads(path.read_text())
        return WorkerEntry(name=info["kvcr_runner"]["name"], url=info["url"], runner="")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _snapshot(control: str) -> tuple[int, list]:
    with ControlClient(control, timeout_s=5.0) as client:
        return client.snapshot()


async def serve(cfg: RouterConfig, info_file: str | None = None) -> None:
    router = Router(cfg)
    router.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    runner = web.AppRunner(router.app(), access_log=None)
    try:
        await asyncio.gather(*(router.discover(e) for e in cfg.workers))
        follower = asyncio.create_task(router.follow_events())
        watchers = [asyncio.create_task(router.watch(source, where)) for source, where in router.discovery_sources()]
        watchers.append(asyncio.create_task(router.check_health()))
        await runner.setup()
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        url = f"http://{cfg.host}:{runner.addresses[0][1]}"
        if info_file:
            tmp = Path(info_file + ".tmp")
            tmp.write_text(json.dumps({"url": url, "workers": [e.name for e in cfg.workers]}))
            os.replace(tmp, info_file)
        log.info("kvcr router at %s, %d workers", url, len(cfg.workers))
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        await done.wait()
        follower.cancel()
        for watcher in watchers:
            watcher.cancel()
    finally:
        await runner.cleanup()
        await router.close()


def run(config: str, overrides: dict[str, Any], *, info_file: str | None = None) -> int:
    asyncio.run(serve(load_router_config(config, overrides), info_file))
    return 0
