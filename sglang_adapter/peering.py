"""How an in-process backend's runner finds its peers and is found by them: its entry in the
registry (etcd, or this host's peers directory) and the feed that follows the others' streams."""

from __future__ import annotations

import atexit
import logging

from kvcr.service import Service

from . import peer_directory
from .config import AdapterConfig
from .peer_directory import PeerDirectory, PeerDirectoryError
from .peer_etcd import EtcdPeers
from .peers import PeerFeed

log = logging.getLogger(__name__)


class Peering:
    def __init__(self, registry: PeerDirectory | EtcdPeers | None, feed: PeerFeed | None) -> None:
        self.registry = registry
        self.feed = feed

    @classmethod
    def join(cls, cfg: AdapterConfig, service: Service) -> "Peering":
        """Leave the runner's public info in the registry, then follow the peers listed or registered
        (when sources without a hint are wanted: `opportunistic`)."""
        registry = _registry(cfg, service.public_info())
        feed = None
        if (cfg.peers or registry is not None) and cfg.opportunistic:
            own = frozenset(p["namespace_digest"] for p in service.runner.info()["pools"])
            # ourselves as peers see us (a wildcard bind is published as the advertised host)
            feed = PeerFeed(list(cfg.peers), service.control_endpoint, service.cfg.curve(), directory=registry,
                            namespaces=own).start()
            service.metrics.register(feed)
        return cls(registry, feed)

    def best_source(self, events: list[int]) -> tuple[str, int] | None:
        """With no hint: the peer that announced the longest run of these pages, and its length."""
        return self.feed.best_source(events) if self.feed is not None else None

    def close(self) -> None:
        if self.feed is not None:  # first: it reads the registry we leave
            self.feed.close()
            self.feed = None
        if self.registry is not None:
            self.registry.leave()
            atexit.unregister(self.registry.leave)
            self.registry = None


def _registry(cfg: AdapterConfig, info: dict) -> PeerDirectory | EtcdPeers | None:
    if cfg.peers_etcd:
        registry = EtcdPeers(cfg.peers_etcd)
        registry.join(info)
        atexit.register(registry.leave)  # seldom run under SGLang: the lease ends the entry then
        log.info("kvcr: peers found through etcd at %s", cfg.peers_etcd)
        return registry
    path = peer_directory.resolve(cfg.peers_dir)
    if path is None:
        return None
    try:
        directory = PeerDirectory(path)
        directory.join(info)
    except (PeerDirectoryError, OSError) as exc:
        log.warning("kvcr: peers on this host are not discovered: %s", exc)
        return None
    # SGLang's exit seldom closes the backend; a killed engine's entry is dropped by its readers.
    atexit.register(directory.leave)
    log.info("kvcr: peers found through %s", path)
    return directory
