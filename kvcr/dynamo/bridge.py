"""A kvcr-backed engine as a Dynamo worker: `python -m kvcr.dynamo.bridge` in Dynamo's environment.

It registers with Dynamo's `DistributedRuntime` (discovery, request and event planes chosen by
Dynamo's own `DYN_*` variables), advertises the runner's control endpoint as a hint source,
relays the runner's event stream through `KvEventPublisher` (via FeedRelay, so restarts and gaps
leave Dynamo's view right), and forwards Dynamo's token requests, `kv_hint` included, to the
engine's `/generate`. The engine is a `kvcr worker` or SGLang with `--hicache-storage-backend
kvcr`; it pulls hinted pages through the same claim, confirm and release path as for our router.
Needs only Dynamo's packages, aiohttp, pyzmq and msgpack: no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import urllib.request
from dataclasses import dataclass

import aiohttp

from ..client import fetch_info
from ..config import CurveKeys
from ..curve_keys import client_http_token
from ..proto.hints import KVCR_WORKER_KEY, WORKER_TYPES, HintError, dynamo_advertisement, parse_envelope
from .feed import FeedRelay
from .requests import BridgeRequestError, StreamDecoder, generate_body

log = logging.getLogger("kvcr.dynamo")
HEARTBEATS_MISSED = 5


class BridgeError(RuntimeError):
    """A misconfiguration found at start; the process exits with its message."""


@dataclass(frozen=True, slots=True)
class RunnerView:
    dp_rank: int
    block_size: int
    events: str
    replay: str | None
    control: str
    dram_capacity: int
    heartbeat_s: float  # 0: the runner sends no heartbeats, so silence proves nothing
    name: str = ""  # the runner's runner.name: the worker's name in a kvcr router
    events_curve: bool = False  # the runner has keys: its events and replay speak CURVE


def _get_json(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.load(resp)


def runner_view(info: dict, *, dp_rank: int | None) -> RunnerView:
    """What the bridge needs from a runner's public info; a DP rank other than the runner's fails here,
    not later as batches Dynamo silently drops."""
    ep = info.get("endpoints") or {}
    if not ep.get("events") or not ep.get("control"):
        raise BridgeError("the runner's info names no events or control endpoint")
    rank = int(info.get("dp_rank", 0))
    if dp_rank is not None and dp_rank != rank:
        raise BridgeError(f"--dp-rank {dp_rank} differs from the runner's runner.dp_rank {rank}: Dynamo would "
                          "drop every batch the runner publishes; set one of them to match the other")
    capacity = sum(int(p.get("num_slots", 0)) for p in info.get("pools") or [])
    return RunnerView(rank, int(info["block_size"]), ep["events"], ep.get("replay"), ep["control"], capacity,
                      float(info.get("heartbeat_s", 0.0)), str(info.get("name", "")), info.get("events_curve") is True)


def feed_keys(runner: RunnerView) -> CurveKeys | None:
    """The deployment keys (KVCR_KEYS_DIR or KVCR_CURVE_*) when the runner's events speak CURVE."""
    if not runner.events_curve:
        return None
    curve = CurveKeys.from_env()
    if curve is None:
        raise BridgeError("the runner's events speak CURVE and the bridge holds no keys: set KVCR_KEYS_DIR to the "
                          "deployment's key directory (docs/security.md)")
    return curve


def dead_after(runner: RunnerView, explicit: float | None) -> float:
    """Silence after which Dynamo is told the runner holds nothing: five missed heartbeats unless
    given, never when the runner does not heartbeat."""
    if explicit is not None:
        return explicit
    return HEARTBEATS_MISSED * runner.heartbeat_s


def fetch_runner_info(backend: str, runner: str | None) -> dict:
    if runner:
        return fetch_info(runner, token=client_http_token())
    info = _get_json(backend.rstrip("/") + "/server_info")
    if "kvcr_runner" not in info:
        raise BridgeError(f"{backend} is not a kvcr worker (no kvcr_runner in /server_info): pass --runner "
                          "with the runner's HTTP URL (an SGLang engine's runner)")
    return info["kvcr_runner"]


class Forwarder:
    """Dynamo's `generate` handler: one streamed `/generate` on the engine per request."""

    def __init__(self, backend: str, *, default_max_tokens: int, oracle: bool, model: str,
                 ranks: tuple[int, ...] | None = None) -> None:
        self.url = backend.rstrip("/") + "/generate"
        self.model = model
        self.ranks = ranks  # a DP engine's ranks: Dynamo's routing.dp_rank picks the one to run on
        self.default_max_tokens = default_max_tokens
        self.oracle = oracle
        self.session: aiohttp.ClientSession | None = None
        self.num_requests = 0
        self.num_hints = 0

    async def generate(self, request: dict, context=None):
        if self.session is None:
            # A streamed chunk carries every output id so far: allow long lines.
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=300),
                                                 read_bufsize=2**22)
        body = generate_body(request, default_max_tokens=self.default_max_tokens, oracle=self.oracle,
                             rid=context.id() if context is not None else None, model=self.model, ranks=self.ranks)
        self.num_requests += 1
        if "kv_hints" in body:
            self.num_hints += 1
            self._log_hint(body["kv_hints"])
        decoder = StreamDecoder()
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                raise BridgeRequestError(f"the engine answered {resp.status}: {(await resp.text())[:500]}")
            async for line in resp.content:
                chunk = decoder.feed(line)
                if chunk is not None:
                    yield chunk
        if not decoder.finished:
            raise BridgeRequestError("the engine's stream ended without a finish reason")

    @staticmethod
    def _log_hint(raw: dict) -> None:
        try:
            hint = parse_envelope(raw)
        except HintError as exc:  # forwarded anyway: the engine refuses it and says why
            log.warning("Dynamo sent a kv_hint the engine will refuse: %s", exc)
            return
        log.info("Dynamo's kv_hint: pull %d blocks from %s", len(hint.block_hashes), hint.source_control_endpoint)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvcr dynamo", description=__doc__.split("\n")[0])
    p.add_argument("--backend", required=True, help="the engine's HTTP URL (a kvcr worker or SGLang)")
    p.add_argument("--runner", help="the runner's HTTP URL (default: from a kvcr worker's /server_info)")
    p.add_argument("--model-path", required=True, help="HF-style model directory the frontend tokenizes with")
    p.add_argument("--model-name", required=True)
    p.add_argument("--namespace", default="kvcr")
    p.add_argument("--component", default="backend")
    p.add_argument("--dp-rank", type=int, help="must equal the runner's runner.dp_rank (checked)")
    p.add_argument("--worker-type", default="aggregated", choices=WORKER_TYPES)
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=16, help="when a request names none")
    p.add_argument("--dead-after", type=float,
                   help="seconds of runner silence after which Dynamo is told it holds nothing (default: five "
                        "of the runner's heartbeats; 0: never)")
    p.add_argument("--oracle", action="store_true", help="ask a kvcr worker to check every answer (tests)")
    p.add_argument("--ready-file", help="write the worker id here once registered")
    return p.parse_args(argv)


def dynamo_planes() -> tuple[str, str, str]:
    """Dynamo's own variables pick discovery (file, etcd, kubernetes), request and event planes."""
    return (os.environ.get("DYN_DISCOVERY_BACKEND", "file"), os.environ.get("DYN_REQUEST_PLANE", "tcp"),
            os.environ.get("DYN_EVENT_PLANE", "zmq"))


def rank_views(info: dict, *, dp_rank: int | None) -> list[RunnerView]:
    """The runner `info` describes and every other DP rank of its engine its info lists (one
    bridge registers them all as one Dynamo worker), in rank order."""
    first = runner_view(info, dp_rank=dp_rank)
    if info.get("dp_size", 1) > 1 and not info.get("dp_ranks"):
        log.warning("the runner is DP rank %d of %d and its HTTP port is ephemeral: its other ranks are not "
                    "registered (fix the engine's runner.http_port)", first.dp_rank, info["dp_size"])
    try:
        others = [runner_view(fetch_info(url, token=client_http_token()), dp_rank=int(rank))
                  for rank, url in info.get("dp_ranks", {}).items() if int(rank) != first.dp_rank]
    except (OSError, TimeoutError, ValueError) as exc:
        raise BridgeError(f"a DP rank of the engine did not answer at its /info: {exc}") from None
    return sorted([first, *others], key=lambda v: v.dp_rank)  # 0..N-1: Dynamo takes a start rank and a size


def runtime_config(ranks: list[RunnerView], args: argparse.Namespace):
    """Dynamo's ModelRuntimeConfig for this worker: capacity, its DP ranks, each rank's hint source."""
    from dynamo.llm import ModelRuntimeConfig

    rc = ModelRuntimeConfig()
    rc.total_kv_blocks = max(1, ranks[0].dram_capacity)  # each rank's runner holds this many
    rc.max_num_seqs = 8
    rc.max_num_batched_tokens = args.context_length
    rc.context_length = args.context_length
    rc.kv_event_publishing_enabled = True
    rc.enable_local_indexer = True  # Dynamo's recovery after a frontend restart asks this indexer
    rc.data_parallel_start_rank = ranks[0].dp_rank
    rc.data_parallel_size = len(ranks)
    for key, value in dynamo_advertisement({r.dp_rank: r.control for r in ranks}, args.worker_type).items():
        rc.set_engine_specific(key, json.dumps(value))
    rc.set_engine_specific(KVCR_WORKER_KEY, json.dumps(kvcr_worker(ranks[0], args)))
    return rc


def kvcr_worker(runner: RunnerView, args: argparse.Namespace) -> dict:
    """How a kvcr router that watches Dynamo's discovery routes to this worker (its worker entry)."""
    if args.runner:
        return {"name": runner.name, "url": args.backend, "runner": args.runner, "engine": "sglang"}
    return {"name": runner.name, "url": args.backend}


def write_ready(path: str, worker_id: int, ranks: list[RunnerView], feeds: list[FeedRelay]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"worker_id": worker_id, "dp_rank": ranks[0].dp_rank, "events": feeds[0].endpoint,
                   "dp_ranks": [r.dp_rank for r in ranks]}, f)
    os.replace(tmp, path)


async def until_stopped(serving: asyncio.Future, feeds: list[FeedRelay], stop: asyncio.Event) -> int:
    """0 on SIGTERM/SIGINT; 1 when serving or the event feed died (so a supervisor sees it, and a
    kvcr worker stops: its runner's pages must not stay in Dynamo with no feed behind them)."""
    while not stop.is_set():
        if serving.done():
            log.error("Dynamo's endpoint stopped serving: %r", serving.exception())
            return 1
        if not all(feed.alive() for feed in feeds):
            log.error("an event feed to Dynamo died; stopping so Dynamo deregisters this worker")
            return 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    return 0


async def serve(args: argparse.Namespace) -> int:
    from dynamo.llm import KvEventPublisher, ModelInput, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # first: a stop during start-up still deregisters
        loop.add_signal_handler(sig, stop.set)
    info = fetch_runner_info(args.backend, args.runner)
    ranks = rank_views(info, dp_rank=args.dp_rank)
    # one URL serves a DP engine's every rank: requests name the one Dynamo chose
    forwarder = Forwarder(args.backend, default_max_tokens=args.max_tokens, oracle=args.oracle,
                          model=args.model_name,
                          ranks=tuple(r.dp_rank for r in ranks) if info.get("dp_size", 1) > 1 else None)
    rt = serving = None
    publishers, feeds = [], []
    try:
        for r in ranks:
            feeds.append(FeedRelay(events=r.events, replay=r.replay, control=r.control, dp_rank=r.dp_rank,
                                   dead_after_s=dead_after(r, args.dead_after), curve=feed_keys(r)).start())
        discovery, request_plane, event_plane = dynamo_planes()
        rt = DistributedRuntime(loop, discovery, request_plane, event_plane=event_plane)
        endpoint = rt.endpoint(f"{args.namespace}.{args.component}.generate")
        rc = runtime_config(ranks, args)
        publishers = [KvEventPublisher(endpoint, kv_block_size=r.block_size, dp_rank=r.dp_rank,
                                       enable_local_indexer=True, zmq_endpoint=feed.endpoint, zmq_topic="")
                      for r, feed in zip(ranks, feeds)]
        worker_type = {"aggregated": WorkerType.Aggregated, "prefill": WorkerType.Prefill,
                       "decode": WorkerType.Decode}[args.worker_type]
        await register_model(ModelInput.Tokens, ModelType.Completions | ModelType.Chat, endpoint, args.model_path,
                             args.model_name, worker_type=worker_type, kv_cache_block_size=ranks[0].block_size,
                             runtime_config=rc)
        worker_id = endpoint.connection_id()
        for r in ranks:
            log.info("kvcr Dynamo worker %s: %s.%s.generate, runner rank %d, hint source %s", worker_id,
                     args.namespace, args.component, r.dp_rank, r.control)
        serving = asyncio.ensure_future(endpoint.serve_endpoint(forwarder.generate))
        if args.ready_file:
            write_ready(args.ready_file, worker_id, ranks, feeds)
        return await until_stopped(serving, feeds, stop)
    finally:
        for publisher in publishers:
            publisher.shutdown()
        for feed in feeds:
            feed.stop()
        await forwarder.close()
        if rt is not None:
            rt.shutdown()
        if serving is not None:
            # Dynamo's runtime finishes its shutdown (deregistration included) through this loop: keep
            # it running until the endpoint has returned, or it calls back into a closed loop.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serving, 5)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        return asyncio.run(serve(args))
    except BridgeError as exc:
        print(f"kvcr dynamo bridge: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
