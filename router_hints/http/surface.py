"""What SGLang's and OpenAI's clients ask a router besides requests (model and server info, flush,
health), and the operator's routes (the index view, the worker list, membership)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Callable

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvcr.text import RequestError, TextTokenizer, request_cache_salt, request_tokens

from ..discovery import DiscoveryError
from ..index import Worker
from ..scoring import Load
from .access import client_auth, operator_refusal, read_body
from .config import RouterConfig, RouterConfigError, WorkerEntry, parse_worker
from .fleet import Fleet

PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
# What every worker answers alike: asked of one routable worker (the next, if it fails).
ANY_WORKER_GETS = ("/v1/models", "/v1/models/{model:.+}", "/model_info", "/get_model_info", "/server_info",
                   "/get_server_info")
RETRYABLE_STATUS = frozenset({502, 503, 504})  # the worker (or a proxy before it) could not serve it
FLUSH_TIMEOUT_S = 120.0  # SGLang's flush waits for running requests up to its `timeout`; ours waits a bit more


class Surface:
    def __init__(self, cfg: RouterConfig, fleet: Fleet, registry: CollectorRegistry, tokenizer: TextTokenizer,
                 debug_view: Callable[[list[int], str | None], dict]) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.registry = registry
        self.tokenizer = tokenizer
        self.debug_view = debug_view

    def routes(self) -> list[web.RouteDef]:
        return [*(web.get(path, self.to_any_worker) for path in ANY_WORKER_GETS),
                web.get("/flush_cache", self.flush_cache), web.post("/flush_cache", self.flush_cache),
                web.get("/health_generate", self.health_generate),
                web.post("/debug/index", self.debug_index), web.get("/metrics", self.metrics_page),
                web.get("/health", self.health), web.get("/workers", self.workers),
                web.post("/admin/workers", self.admin_add), web.delete("/admin/workers/{name}", self.admin_remove)]

    async def debug_index(self, request: web.Request) -> web.Response:
        refusal = operator_refusal(self.cfg, request)
        if refusal:
            return web.json_response({"error": {"message": f"/debug/index: {refusal}"}}, status=403)
        route = request.query.get("route", "generate")
        if route not in PATHS:
            return web.json_response({"error": {"message": f"route must be one of {sorted(PATHS)}"}}, status=400)
        try:
            body = await read_body(request)
            tokens = request_tokens(body, route, self.tokenizer)
            salt = request_cache_salt(body)
        except RequestError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        try:
            return web.json_response(self.debug_view(tokens, salt))
        except LookupError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def to_any_worker(self, request: web.Request) -> web.Response:
        """The model list, model and server info: every worker answers them alike, so the first
        routable worker that answers does (sglang-router asks its first worker too)."""
        problems = []
        for worker in self.fleet.routable():
            entry = self.fleet.entries[worker]
            try:
                async with self.fleet.session.get(entry.url.rstrip("/") + request.path_qs, headers=client_auth(request),
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
                async with self.fleet.session.request(method, entry.url.rstrip("/") + path, headers=client_auth(request),
                                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as up:
                    return entry.name, up.status, (await up.text()).strip()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return entry.name, 0, repr(exc)
        return list(await asyncio.gather(*(ask(self.fleet.entries[w]) for w in workers)))

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Every worker's cache, as SGLang's flush_cache: 200 when every worker flushed; 400, as
        SGLang answers, when one refused because requests still run; else 502 (one did not answer)."""
        refusal = operator_refusal(self.cfg, request)
        if refusal:  # it empties every worker's cache
            return web.json_response({"error": {"message": f"/flush_cache: {refusal}"}}, status=403)
        answers = await self._ask_every_worker(request, "POST", request.path_qs, FLUSH_TIMEOUT_S, list(self.fleet.entries))
        lines = "".join(f"{name}: {status or 'no answer'} {text}\n" for name, status, text in answers)
        if all(status == 200 for _, status, _ in answers):
            return web.Response(text=f"Cache flushed on all {len(answers)} workers.\n{lines}")
        status = 400 if any(status == 400 for _, status, _ in answers) else 502
        return web.Response(status=status, text=f"Cache not flushed on every worker.\n{lines}")

    async def health_generate(self, request: web.Request) -> web.Response:
        """Healthy when a routable worker generates (SGLang's /health_generate on each, at once)."""
        answers = await self._ask_every_worker(request, "GET", "/health_generate", self.cfg.request_timeout_s,
                                               self.fleet.routable())
        lines = "".join(f"{name}: {status or 'no answer'}\n" for name, status, _ in answers)
        ok = any(status == 200 for _, status, _ in answers)
        return web.Response(status=200 if ok else 503, text=lines or "no routable worker\n")

    async def workers(self, request: web.Request) -> web.Response:
        return web.json_response([{"name": e.name, "url": e.url, "dp_rank": w[1], "alive": not self.fleet.core.liveness.is_dead(w),
                                   "events": self.fleet.core.publishers[w].events, "control": self.fleet.core.publishers[w].control,
                                   "load": asdict(self.fleet.core.loads.get(w, Load()))} for w, e in self.fleet.entries.items()])

    async def admin_add(self, request: web.Request) -> web.Response:
        refusal = operator_refusal(self.cfg, request)
        if refusal:
            return web.json_response({"error": {"message": f"/admin/workers: {refusal}"}}, status=403)
        try:
            entry = parse_worker(await read_body(request))
        except (RequestError, RouterConfigError) as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if self.fleet.by_name(entry.name) is not None:
            return web.json_response({"error": {"message": f"worker {entry.name!r} is already routed to"}},
                                     status=409)
        try:
            await self.fleet.discover(entry, timeout_s=10.0)
        except DiscoveryError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=502)
        return web.json_response({"added": entry.name})

    async def admin_remove(self, request: web.Request) -> web.Response:
        refusal = operator_refusal(self.cfg, request)
        if refusal:
            return web.json_response({"error": {"message": f"/admin/workers: {refusal}"}}, status=403)
        name = request.match_info["name"]
        if self.fleet.by_name(name) is None:
            return web.json_response({"error": {"message": f"no worker named {name!r}"}}, status=404)
        self.fleet.leave(name)
        return web.json_response({"removed": name})
