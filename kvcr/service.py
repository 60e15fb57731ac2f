"""`kvcr serve`: a runner with its event stream, control socket and HTTP endpoint."""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING

import zmq

from . import __version__
from .config import Config
from .drivers.claim_holder import ClaimHolder
from .drivers.http import HttpServer
from .drivers.local_control import socket_path
from .drivers.control_handlers import ControlHandlers
from .drivers.zmq_control import ControlServer
from .drivers.zmq_curve import CurveGate
from .drivers.zmq_events import EventPublisher, SeqSource
from .drivers.zmq_relay import EngineRelay
from .metrics import make_registry
from .proto.messages import CAPABILITIES, PROTOCOL_MAJOR, PROTOCOL_MINOR
from .peer_pulls import PeerPulls
from .ranks import advertised, default_route_address, is_wildcard
from .runner import open_store

if TYPE_CHECKING:
    from .drivers.puller import Puller
    from .drivers.ucx_plane import UcxPlane

log = logging.getLogger(__name__)


class Service:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        curve = cfg.curve()
        self.gate = CurveGate(self.ctx, curve) if curve is not None else None  # one per context
        ev = cfg.events
        self.publisher = EventPublisher(self.ctx, endpoint=ev.endpoint, replay_endpoint=ev.replay_endpoint,
                                        topic=ev.topic, dp_rank=cfg.runner.dp_rank, buffer_steps=ev.buffer_steps,
                                        queue_size=ev.queue_size, seq=SeqSource(cfg.runner.state_dir),
                                        heartbeat_s=ev.heartbeat_s, gate=self.gate if cfg.events_curve else None)
        self.store = open_store(cfg, publish=self.publisher.publish)
        self.runner = self.store.runner
        self.plane: UcxPlane | None = None
        puller = None
        if cfg.runner.ucx:
            from .drivers.ucx_plane import UcxPlane  # loads libucx: only when peers are served

            self.plane = UcxPlane(lanes=cfg.runner.pull_lanes, interface=cfg.runner.ucx_interface)
            puller = self._puller(self.plane)
        # The one owner of the claims this runner takes at peers (its own pulls and an embedding
        # SGLang backend's).
        self.claims = ClaimHolder(lambda: puller) if puller is not None else None
        self.pulls = PeerPulls(self.runner, self.claims)
        handlers = ControlHandlers(self.runner, self.pulls, self.plane, lower=self.store.lower, shards=self.store.shards,
                                   info=self.info, snapshot=self.snapshot, public_info=self.public_info)
        self.control = ControlServer(self.ctx, handlers, endpoint=cfg.runner.control_endpoint, gate=self.gate,
                                     tcp_serves_region=cfg.secured or cfg.runner.insecure,
                                     local_path=socket_path(self.runner.region.path) if cfg.runner.local_control else "")
        self.relay = EngineRelay(self.ctx, self.runner, self.runner.events, endpoint=ev.engine_endpoint,
                                 replay_endpoint=ev.engine_replay_endpoint,
                                 hold_s=ev.engine_hold_s) if ev.engine_endpoint else None
        self.metrics = make_registry(self)  # an embedding process may register its own collectors here
        self.http = HttpServer(cfg.runner.http_host, cfg.runner.http_port, registry=self.metrics,
                               info=self.public_info, health=self.health, token=cfg.http_token())
        self.stopped = threading.Event()
        self._advertise_host: str | None = None  # looked up once, when a wildcard bind is first published
        self._housekeeper = threading.Thread(target=self._housekeeping, name="kvcr-housekeeping", daemon=True)

    def _puller(self, plane: UcxPlane) -> Puller:
        from .drivers.puller import Puller  # with the plane: loads libucx
        from .proto.reach import Reachability

        r, layouts = self.cfg.runner, self.runner.layouts
        return Puller(plane, {name: lay.namespace.fields() for name, lay in layouts.items()},
                      timeout_s=r.pull_timeout_s, abandon_s=r.pull_abandon_s, control_timeout_s=r.control_timeout_s,
                      reach=Reachability(r.unreachable_backoff_s, r.reach_probe_s),
                      trusted=None if "*" in r.peers else frozenset(r.peers), insecure=r.insecure,
                      curve=self.cfg.curve(),
                      verify_transfer_bytes=self.cfg.page_digests, transport=r.transfer,
                      copy_threads=r.copy_threads, local_control=r.local_control, reply_spin_s=r.reply_spin_us / 1e6,
                      inline_max=r.inline_pull_bytes, page_bytes={n: lay.page_bytes for n, lay in layouts.items()})

    def _housekeeping(self) -> None:
        while not self.stopped.wait(0.05):
            try:
                self.store.housekeeping()
                self.pulls.housekeeping()
            except Exception:  # a failed pass is logged and retried; it must not stop leases expiring
                log.exception("housekeeping pass failed")

    def start(self) -> "Service":
        self.publisher.start()
        if self.plane is not None:
            self.plane.register_region(self.runner.region.address, self.runner.region.size,
                                       ranges=[(lay.offset, lay.stride * lay.num_slots, lay.stride)
                                               for lay in self.runner.layouts.values()])
        self.runner.events.announce_start()
        self.store.start_scans()
        self._housekeeper.start()
        if self.relay is not None:
            self.relay.start()
        self.control.start()
        self.http.start()
        log.info("kvcr runner %s up: events %s, control %s, http %s", self.cfg.runner.name,
                 self.publisher.bound_endpoint, self.control.bound_endpoint, self.http.url)
        return self

    def snapshot(self) -> tuple[int, list]:
        """The inventory and the seq of the last batch it reflects (taken atomically)."""
        with self.runner.lock:
            engine = self.relay.mirror.inventory() if self.relay is not None else []
            return self.publisher.last_seq, [*self.runner.events.inventory(), *engine]

    def health(self) -> list[str]:
        """What is broken (empty when healthy): a dead thread stops events or requests silently."""
        parts = [self.publisher, self.control, *([self.relay] if self.relay is not None else [])]
        problems = [p.health() for p in parts]
        if not self._housekeeper.is_alive() and not self.stopped.is_set():
            problems.append("housekeeping thread is gone")
        if not self.store.healthy() and not self.stopped.is_set():
            problems.append("NVMe persister thread is gone")
        return [p for p in problems if p]

    def info(self) -> dict:
        r = self.cfg.runner
        return {"version": __version__, "protocol": [PROTOCOL_MAJOR, PROTOCOL_MINOR],
                "capabilities": list(CAPABILITIES), "incarnation": self.runner.incarnation,
                "name": r.name, "dp_rank": r.dp_rank, "dp_size": r.dp_size, "dp_ranks": self._rank_urls(),
                "block_size": r.block_size, "event_format": self.cfg.events.event_format,
                "heartbeat_s": self.cfg.events.heartbeat_s, "events_curve": self.cfg.events_curve,
                "endpoints": {"events": self._advertised(self.publisher.bound_endpoint),
                              "replay": self._advertised(self.publisher.bound_replay_endpoint),
                              "control": self.control_endpoint,
                              "http": self._advertised(self.http.url), "local_control": self.control.local_path},
                "relays_engine": self.relay is not None,
                "ucx": self._ucx_info(),
                "topic": self.cfg.events.topic, **self.runner.info()}

    @property
    def control_endpoint(self) -> str:
        """The control endpoint peers dial (what info publishes)."""
        return self._advertised(self.control.bound_endpoint)

    def _advertised(self, endpoint: str) -> str:
        if not is_wildcard(endpoint):
            return endpoint
        if self._advertise_host is None:
            self._advertise_host = self.cfg.runner.advertise_host or default_route_address()
        return advertised(endpoint, self._advertise_host)

    def _rank_urls(self) -> dict[str, str]:
        """Every DP rank's /info, where the ranks' HTTP ports are fixed (base + rank): one rank's
        info finds the others. Ephemeral ports leave it empty."""
        r = self.cfg.runner
        if r.dp_size == 1 or r.http_port == 0:
            return {}
        own = self._advertised(self.http.url)
        base, port = own.rsplit(":", 1)
        return {str(k): f"{base}:{int(port) - r.dp_rank + k}" for k in range(r.dp_size)}

    def public_info(self) -> dict:
        """info() without what addresses our region (UCX worker address, region base, rkeys): for
        HTTP, the info file, logs and a keyless runner's TCP control socket. Those travel only in
        control replies authenticated with CURVE, or over the same-host socket (our own user)."""
        info = self.info()
        if info["ucx"] is not None:
            info["ucx"] = {"registered_bytes": info["ucx"]["registered_bytes"]}
        return info

    def _ucx_info(self) -> dict | None:
        """What a peer needs to GET our pages: worker address, region base and the packed rkeys."""
        if self.plane is None:
            return None
        return {"address": self.plane.address.hex(), "region_base": self.runner.region.address,
                "registered_bytes": self.plane.registered_bytes,
                "rkeys": [[c.offset, c.length, c.rkey.hex()] for c in self.plane.chunks]}

    def stop(self) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        self._housekeeper.join(5)
        self.control.stop()
        if self.relay is not None:
            self.relay.stop()
        if self.store.lower.pools:  # nothing commits now; /metrics shows the flush while it runs
            self.store.flush()
        self.http.stop()
        self.pulls.close()
        if self.plane is not None:
            self.plane.close()
        self.store.shutdown()  # publishes the removals before the publisher drains and closes
        self.publisher.stop()
        if self.gate is not None:
            self.gate.stop()
        self.ctx.term()

    def serve_forever(self) -> None:
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        while not done.wait(0.5):
            pass
        self.stop()
