"""`kvcr router`: hash each request's pages, pick the cheapest worker from the live index and
load, name a peer to pull the rest from, and forward the request unchanged but for the hint.

This module is the request path; its parts: fleet.py (the workers: joining, leaving, health),
hint_poster.py, surface.py (the routes besides requests), access.py, metrics.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvcr.config import CurveKeys
from kvcr.text import RequestError, TextTokenizer, request_cache_salt, request_tokens

from ..breaker import Breakers
from ..core import Route, RouterCore
from ..index import NO_OVERLAP, Worker
from ..rates import tier_weights
from ..scoring import Load
from . import front
from .access import client_auth, operator_refusal, read_body
from .config import RouterConfig, WorkerEntry, load_router_config
from .fleet import Fleet
from .hint_poster import HintPoster
from .metrics import MeasuredCosts, RouterMetrics
from .surface import PATHS, RETRYABLE_STATUS, Surface

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Failed:
    """A worker failed a request before the answer's first byte: it may still go elsewhere."""

    reason: str
    refused: bool  # nothing listened: the worker is gone or restarting
    answer: tuple[int, str, bytes] | None = None  # the worker's own answer (status, content type, body), if any
    # A worker silent for request_timeout_s is failing, but the request may just be long: running
    # it again elsewhere could keep the client waiting that long once more per retry.
    retry: bool = True


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.tokenizer = TextTokenizer(cfg.tokenizer or None)
        self.core = RouterCore(block_size=cfg.block_size, model=cfg.cost, dead_after_s=cfg.dead_after_s,
                               curve=CurveKeys.from_env(), measure_costs=cfg.measure_costs)
        self.breakers = Breakers(cfg.breaker_failures)
        costs = MeasuredCosts(self.core, cfg.measure_costs, lambda worker: self.fleet.worker_name(worker))
        self.metrics = RouterMetrics(self.core, self.breakers, costs)
        self.fleet = Fleet(cfg, self.core, self.breakers, self.metrics)
        self.hints = HintPoster(self.core, self.metrics)
        self.surface = Surface(cfg, self.fleet, self.metrics.registry, self.tokenizer, self.debug_view)

    def open(self) -> None:
        """Open the connections to workers (in the event loop that serves)."""
        self.fleet.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    # --- routing ---------------------------------------------------------------------------------

    def decide(self, tokens: list[int], pinned: str | None = None, cache_salt: str | None = None,
               tried: frozenset[Worker] = frozenset()) -> Route:
        """Where a request goes; workers whose requests fail (breaker open) and those this request
        already failed on (`tried`) are left out, unless pinned."""
        start = time.perf_counter()
        self.core.poll(0)  # whatever arrived since the last tick
        worker = None
        if pinned is not None:
            worker = self.fleet.by_name(pinned)
            if worker is None:
                raise RequestError(f"X-KVCR-Target names no worker: {pinned!r}")
        decision = self.core.route(tokens, pinned=worker, cache_salt=cache_salt, excluded=tried | self.breakers.open)
        self.metrics.route_seconds.observe(time.perf_counter() - start)
        return decision

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
                        *self.surface.routes()])
        return app

    def _handler(self, route: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            refusal = operator_refusal(self.cfg, request) if "X-KVCR-Target" in request.headers else ""
            if refusal:
                return web.json_response({"error": {"message": f"X-KVCR-Target: {refusal}"}}, status=403)
            pinned = request.headers.get("X-KVCR-Target")
            try:
                body, removed = front.strip_client_hints(await read_body(request))
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
            failed_on = self.fleet.worker_name(target)
            failures.append(f"worker {failed_on}: {outcome.reason}")
            self._count_failure(target, failed_on, outcome)
            last = outcome
        self.metrics.failed.labels(route).inc()
        if last is not None and last.answer is not None:  # the last worker's own refusal, as it gave it
            status, content_type, raw = last.answer
            return web.Response(status=status, body=raw, headers={"Content-Type": content_type})
        return web.json_response({"error": {"message": "; ".join(failures)}}, status=502)

    def _count_failure(self, target: Worker, name: str, outcome: Failed) -> None:
        self.metrics.upstream_errors.labels(name).inc()
        if self.breakers.failed(target, refused=outcome.refused):
            self.metrics.breaker_trips.labels(name).inc()
            log.warning("worker %s taken out of routing until its health check passes: %s", name, outcome.reason)

    async def _attempt(self, request: web.Request, route: str, body: dict, tokens: list[int], decision: Route
                       ) -> web.StreamResponse | Failed:
        target = decision.choice.worker
        entry = self.fleet.entries[target]
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
            if target in self.fleet.ranked:  # one URL serves every rank: SGLang's DP controller routes by this
                body = {**{k: v for k, v in body.items() if k != "data_parallel_rank"}, "routed_dp_rank": target[1]}
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
        posted = await self.hints.post(target, hint) if self.cfg.post_hints else False
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
        headers = client_auth(request)
        resp: web.StreamResponse | None = None
        sent = time.monotonic()
        try:
            async with self.fleet.session.post(entry.url.rstrip("/") + PATHS[route], json=body, timeout=timeout,
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
                    "Content-Type": up.headers.get("Content-Type", "application/json"), "X-KVCR-Worker": entry.name,
                    **({"X-KVCR-DP-Rank": str(decision.choice.worker[1])} if decision.choice.worker in self.fleet.ranked
                       else {})})
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
        self.metrics.decisions.labels(self.fleet.entries[decision.choice.worker].name, route).inc()
        o = decision.choice.overlap
        for tier, n in (("device", o.device), ("host", o.host), ("dram", o.dram), ("disk", o.disk),
                        ("runner", o.runner)):
            self.metrics.overlap.labels(tier).inc(n)

    async def close(self) -> None:
        if self.fleet.session is not None:
            await self.fleet.session.close()
        self.hints.close()
        self.core.close()


async def serve(cfg: RouterConfig, info_file: str | None = None) -> None:
    router = Router(cfg)
    router.open()
    runner = web.AppRunner(router.app(), access_log=None)
    try:
        await asyncio.gather(*(router.fleet.discover(e) for e in cfg.workers))
        follower = asyncio.create_task(router.fleet.follow_events())
        watchers = [asyncio.create_task(router.fleet.watch(source, where)) for source, where in router.fleet.discovery_sources()]
        watchers.append(asyncio.create_task(router.fleet.check_health()))
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
