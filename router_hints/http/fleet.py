"""The workers a router routes to: how each joins (found through its runner's info, its inventory
loaded), leaves, is health-checked back into routing and followed when its runner moves, and the
membership sources that add and remove them at run time."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Callable

import aiohttp

from kvcr.client import ControlClient, ControlError, fetch_info
from kvcr.curve_keys import client_http_token

from ..breaker import Breakers
from ..core import RouterCore
from ..discovery import DiscoveryError, Publisher, from_runner_info
from ..index import Worker
from .config import RouterConfig, WorkerEntry
from .dynamo_discovery import entries_from_cards, fetch_cards
from .metrics import RouterMetrics

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 2.0
DISCOVERY_TIMEOUT_S = 10.0  # one try at a worker's /server_info: a hung worker must not hold the health checks


class Fleet:
    def __init__(self, cfg: RouterConfig, core: RouterCore, breakers: Breakers, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.core = core
        self.breakers = breakers
        self.metrics = metrics
        self.entries: dict[Worker, WorkerEntry] = {}
        self.rank_info: dict[Worker, str | None] = {}  # a DP rank's /info found through another rank's
        self.ranked: set[Worker] = set()  # ranks of a DP engine: requests to them name the rank
        self.session: aiohttp.ClientSession | None = None  # opened in the event loop (Router.open)

    def by_name(self, name: str) -> Worker | None:
        return next((w for w, e in self.entries.items() if e.name == name), None)

    async def discover(self, entry: WorkerEntry, timeout_s: float = 120.0) -> None:
        """Find the worker's runner through info endpoints (retrying while it starts), and every
        DP rank's runner its info lists: each rank is a worker (name, rank) of its own."""
        deadline = time.monotonic() + timeout_s
        info, first = await self._info_until(entry, None, deadline)
        found = [(first, None)]
        ranks = {int(rank): url for rank, url in info.get("dp_ranks", {}).items() if int(rank) != info["dp_rank"]}
        dp = info.get("dp_size", 1) > 1  # requests name the rank: one URL serves them all
        if dp and not ranks:
            log.warning("worker %s: DP rank %d of %d, and its runner's HTTP port is ephemeral: its other ranks are "
                        "not found (fix the engine's runner.http_port)", entry.name, info["dp_rank"], info["dp_size"])
        for rank, url in sorted(ranks.items()):
            found.append(((await self._info_until(entry, url, deadline))[1], url))
        for publisher, url in found:
            worker = (publisher.worker_id, publisher.dp_rank)
            if worker in self.entries:  # found already, through another rank's entry
                continue
            self.core.add(publisher)
            self.entries[worker] = entry
            self.rank_info[worker] = url
            if dp:
                self.ranked.add(worker)
            await self.resync(worker)
            log.info("worker %s (DP rank %d): events %s, control %s", entry.name, publisher.dp_rank,
                     publisher.events, publisher.control)

    async def _info_until(self, entry: WorkerEntry, url: str | None, deadline: float) -> tuple[dict, Publisher]:
        """A runner's info and the publisher it describes, retried until `deadline`."""
        while True:
            try:
                info = await self._runner_info(entry, url)
                return info, from_runner_info(entry.name, info, block_size=self.cfg.block_size, role=entry.role)
            except (OSError, TimeoutError, aiohttp.ClientError, KeyError) as exc:
                if time.monotonic() > deadline:
                    raise DiscoveryError(f"worker {entry.name}: no runner info at {url or entry.runner or entry.url} "
                                         f"in time: {exc}") from None
                await asyncio.sleep(0.5)

    async def _runner_info(self, entry: WorkerEntry, url: str | None = None) -> dict:
        """The runner's info: at `url` (a DP rank's /info), the entry's runner, or its /server_info."""
        if url or entry.runner:
            return await asyncio.to_thread(fetch_info, url or entry.runner,
                                           token=entry.runner_token or client_http_token())
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
            info = await self._runner_info(entry, self.rank_info.get(worker))
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
                    if key not in joined and self.by_name(entry.name) is None:
                        joined[key] = entry.name
                        asyncio.create_task(self._join(entry, where))
                for key in [k for k in joined if k not in seen]:
                    self.leave(joined.pop(key))
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
        found = ((str(p), entry_from_info_file(p)) for p in Path(self.cfg.discovery_dir).glob("*.json"))
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

    def leave(self, name: str) -> None:
        gone = [w for w, e in self.entries.items() if e.name == name]
        self.core.remove(name)
        for worker in gone:
            del self.entries[worker]
            self.rank_info.pop(worker, None)
            self.ranked.discard(worker)
            self.breakers.forget(worker)
        log.info("worker %s left the routing", name)

    def routable(self) -> list[Worker]:
        """Workers that take requests now: events alive, breaker closed (in a stable order)."""
        return [w for w in self.core.alive() if not self.breakers.is_open(w) and w in self.entries]

    def worker_name(self, worker: Worker) -> str:
        entry = self.entries.get(worker)  # it may have left while its request ran
        return entry.name if entry is not None else worker[0]


def entry_from_info_file(path: Path) -> WorkerEntry | None:
    """A `kvcr worker --info-file` file as a worker entry; None while it is partial or not one."""
    try:
        info = json.loads(path.read_text())
        return WorkerEntry(name=info["kvcr_runner"]["name"], url=info["url"], runner="")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _snapshot(control: str) -> tuple[int, list]:
    with ControlClient(control, timeout_s=5.0) as client:
        return client.snapshot()
