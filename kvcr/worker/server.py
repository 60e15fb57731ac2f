"""`kvcr worker`: the engine behind SGLang-compatible `/generate` and OpenAI routes (aiohttp)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

from ..text import RequestError, TextTokenizer, refuse_lora, request_cache_salt, request_tokens

from ..metrics import RunnerCollector
from ..proto.hints import FetchHint, HintError, extract_request_hint, parse_envelope
from ..service import Service
from . import responses as r
from .engine import POOL, Engine

log = logging.getLogger(__name__)
SERVED_KEPT = 4096  # requests remembered for /kvcr/served/{rid}


@dataclass(frozen=True, slots=True)
class Job:
    tokens: list[int]
    max_new_tokens: int
    stream: bool
    include_usage: bool
    rid: str
    hint: FetchHint | None
    oracle: bool
    ignore_eos: bool
    cache_salt: str | None = None  # the tenant's namespace: its pages are keyed and announced under it


def _int_field(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RequestError(f"{key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def parse_job(body: Any, route: str, tokenizer: TextTokenizer, max_positions: int) -> Job:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    refuse_lora(body)
    tokens = request_tokens(body, route, tokenizer)
    if route == "generate":
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise RequestError("sampling_params must be an object")
        max_new = _int_field(sampling, "max_new_tokens", 16, 1, max_positions)
        ignore_eos = bool(sampling.get("ignore_eos", False))
    else:
        max_new = _int_field(body, "max_completion_tokens", _int_field(body, "max_tokens", 16, 1, max_positions),
                             1, max_positions)
        ignore_eos = bool(body.get("ignore_eos", False))
    if len(tokens) + max_new > max_positions:
        raise RequestError(f"{len(tokens)} prompt tokens + {max_new} new tokens exceed the model's "
                           f"{max_positions} positions")
    raw_hint = extract_request_hint(body)
    try:
        hint = parse_envelope(raw_hint) if raw_hint is not None else None
    except HintError as exc:
        raise RequestError(f"kv_hint rejected: {exc}") from None
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object")
    return Job(tokens, max_new, bool(body.get("stream", False)), bool(options.get("include_usage")),
               str(body.get("rid") or uuid.uuid4().hex), hint, bool(body.get("kvcr_oracle", False)), ignore_eos,
               request_cache_salt(body))


class WorkerCollector:
    def __init__(self, worker: "Worker") -> None:
        self.worker = worker

    def collect(self) -> Iterator:
        stats = self.worker.engine.stats.as_dict()
        for tier in ("dram", "nvme", "peer"):
            c = CounterMetricFamily("kvcr_worker_cached_pages", "Prompt pages served from cache, by tier",
                                    labels=["tier"])
            c.add_metric([tier], stats[f"{tier}_pages"])
            yield c
        for key, help_ in (("requests", "Requests served"), ("prompt_tokens", "Prompt tokens"),
                           ("generated_tokens", "Tokens generated"), ("stored_pages", "Pages stored in the runner"),
                           ("oracle_checks", "Oracle comparisons run"), ("oracle_mismatches", "Oracle mismatches")):
            yield CounterMetricFamily(f"kvcr_worker_{key}", help_, value=stats[key])
        yield CounterMetricFamily("kvcr_worker_prefill_seconds", "Prefill compute time", value=stats["prefill_s"])
        yield CounterMetricFamily("kvcr_worker_prefill_saved_seconds", "Prefill time saved by cached pages (estimate)",
                                  value=stats["saved_s"])
        yield GaugeMetricFamily("kvcr_worker_inflight", "Requests in flight", value=self.worker.inflight)


class Worker:
    def __init__(self, service: Service, engine: Engine, tokenizer: TextTokenizer, model_name: str) -> None:
        self.service = service
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.inflight = 0
        # rid -> what serving it took (the response's `kvcr` section): for a router that does not pass
        # our response extensions back (Dynamo's frontend), looked up by the request id it sent.
        self.served: OrderedDict[str, dict] = OrderedDict()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcr-engine")  # one model step at a time
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RunnerCollector(service))
        self.registry.register(WorkerCollector(self))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.add_routes([web.post("/generate", self._route("generate")),
                        web.post("/v1/completions", self._route("completions")),
                        web.post("/v1/chat/completions", self._route("chat")),
                        web.get("/health", self.health), web.get("/health_generate", self.health),
                        web.get("/server_info", self.server_info), web.get("/get_server_info", self.server_info),
                        web.get("/v1/models", self.models), web.get("/v1/models/{model:.+}", self.model),
                        web.get("/model_info", self.model_info), web.get("/get_model_info", self.model_info),
                        web.get("/flush_cache", self.flush_cache), web.post("/flush_cache", self.flush_cache),
                        web.get("/metrics", self.metrics),
                        web.get("/info", self.server_info), web.get("/kvcr/served/{rid}", self.served_request)])
        return app

    def info(self) -> dict:
        return {"model": self.model_name, "page_size": self.engine.page_size, "kvcr_runner": self.service.public_info(),
                "stats": self.engine.stats.as_dict(), "inflight": self.inflight, "tiers": self.tiers(),
                "model_config": asdict(self.engine.model.cfg)}

    def tiers(self) -> dict:
        """Pages held per tier and the runner's own counters (for the demo's live view)."""
        stats = self.service.runner.statistics()
        tier = stats.tier(POOL)
        pool, disk = tier.dram, tier.nvme
        return {"dram_pages": pool.num_ready, "dram_capacity": pool.capacity,
                "nvme_pages": disk.num_pages if disk is not None else 0, "page_bytes": pool.page_bytes,
                "pulled_pages": self.service.pulls.statistics().pulled, "spilled_pages": stats.nvme.spilled,
                "promoted_pages": stats.nvme.promoted,
                "events": self.service.publisher.num_events}

    async def health(self, request: web.Request) -> web.Response:
        problems = self.service.health()
        return web.Response(status=503 if problems else 200, text="\n".join(problems) or "ok")

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.info())

    async def served_request(self, request: web.Request) -> web.Response:
        record = self.served.get(request.match_info["rid"])
        if record is None:
            return web.json_response({"error": {"message": "no such request served here (recently)"}}, status=404)
        return web.json_response(record)

    def _remember(self, served: r.Served, hinted: bool) -> None:
        self.served[served.rid] = {**r.meta_info(served, 0, None)["kvcr"], "prompt_tokens": served.info.prompt_tokens,
                                   "hinted": hinted}
        self.served.move_to_end(served.rid)  # a reused rid is the newest
        while len(self.served) > SERVED_KEPT:
            self.served.popitem(last=False)

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "root": self.model_name, "owned_by": "kvcr",
                "max_model_len": self.engine.model.cfg.max_positions}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_name:
            return web.json_response({"error": {"message": f"The model '{request.match_info['model']}' does not exist",
                                                "type": "invalid_request_error", "param": "model",
                                                "code": "model_not_found"}}, status=404)
        return web.json_response(self._card())

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_name, "served_model_name": self.model_name,
                                  "tokenizer_path": None, "is_generation": True,
                                  "model_type": "kvcr-tiny", "architectures": [type(self.engine.model).__name__]})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Its only cache is its runner: dropped whole, as SGLang's flush_cache (refused, with the
        same 400, while requests run)."""
        if self.inflight:
            return web.Response(status=400, text=f"Flush cache failed: {self.inflight} requests are running.\n")
        removed = await asyncio.to_thread(self.service.runner.clear, POOL)
        return web.Response(text=f"Cache flushed ({removed} pages).\n")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _route(self, route: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                return web.json_response({"error": {"message": f"body is not JSON: {exc}"}}, status=400)
            try:
                job = parse_job(body, route, self.tokenizer, self.engine.model.cfg.max_positions)
            except RequestError as exc:
                return web.json_response({"error": {"message": str(exc)}}, status=400)
            self.inflight += 1
            try:
                return await self._serve(request, route, job)
            finally:
                self.inflight -= 1
        return handle

    async def _run(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    async def _serve(self, request: web.Request, route: str, job: Job) -> web.StreamResponse:
        stop = frozenset() if job.ignore_eos or self.tokenizer.eos_id is None else frozenset({self.tokenizer.eos_id})
        info, steps = await self._run(self.engine.generate, job.tokens, job.max_new_tokens, hint=job.hint,
                                      oracle=job.oracle, stop_ids=stop, cache_salt=job.cache_salt)
        served = r.Served(job.rid, int(time.time()), self.model_name, route, info, self.engine.page_size)
        self._remember(served, job.hint is not None)
        if not job.stream:
            ids = await self._run(list, steps)
            finish = "stop" if ids and ids[-1] in stop else "length"
            return web.json_response(r.final_body(served, self.tokenizer.decode(ids), ids, finish))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if route == "chat":  # OpenAI streams open with the role
            await resp.write(r.sse(r.role_chunk(served)))
        ids: list[int] = []
        text = ""
        while (token := await self._run(next, steps, None)) is not None:
            ids.append(token)
            new_text = self.tokenizer.decode(ids)
            finish = None
            if len(ids) == job.max_new_tokens or token in stop:
                finish = "stop" if token in stop else "length"
            await resp.write(r.sse(r.stream_chunk(served, new_text, new_text[len(text):], ids, finish)))
            text = new_text
        if job.include_usage and route != "generate":
            await resp.write(r.sse(r.usage_chunk(served, len(ids))))
        await resp.write(r.sse("[DONE]"))
        await resp.write_eof()
        return resp


async def serve(worker: Worker, host: str, port: int, info_file: str | None,
                companion: Callable[[str], subprocess.Popen] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; the runner (shared memory, UCX, threads) stops on every way out.
    `companion(url)` starts a process that lives as long as we do (the Dynamo bridge): if it exits,
    so do we, with its exit status."""
    runner = web.AppRunner(worker.app(), access_log=None)
    child = None
    try:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        url = f"http://{host}:{runner.addresses[0][1]}"
        if info_file:
            tmp = Path(info_file + ".tmp")
            tmp.write_text(json.dumps({"url": url, **worker.info()}))
            os.replace(tmp, info_file)
        log.info("kvcr worker %s serving %s at %s", worker.service.cfg.runner.name, worker.model_name, url)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        child = companion(url) if companion is not None else None
        while not done.is_set():
            if child is not None and child.poll() is not None:
                log.error("the Dynamo bridge exited with status %s; stopping", child.returncode)
                return child.returncode or 1
            try:
                await asyncio.wait_for(done.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        return 0
    finally:
        if child is not None:
            from ..dynamo.launch import stop_process

            stop_process(child, 5.0)  # within what the demo and tests give the worker to stop
        await runner.cleanup()
        worker.executor.shutdown(wait=True, cancel_futures=True)
        worker.service.stop()
