"""One engine, several DP ranks: each rank's runner is a peer of its own, bound at the operator's
base ports plus its rank (as SGLang offsets its KV-event ports), with its own state under the
base directories. Every rank checks the whole group's ports, so a range that runs past 65535 is
refused on every rank before any of them binds or publishes."""

from __future__ import annotations

import re
import socket
from dataclasses import replace
from pathlib import Path

from .config import WILDCARD_HOSTS, Config, ConfigError

_TCP = re.compile(r"(tcp://.+):(\d+)")


def rank_endpoint(key: str, endpoint: str, rank: int, size: int) -> str:
    """`endpoint` for `rank` of `size`: tcp ports + rank (0, an ephemeral port, stays 0), an ipc
    path suffixed -dp<rank>; refused by key when the last rank's port would pass 65535."""
    if not endpoint:
        return endpoint
    m = _TCP.fullmatch(endpoint)
    if m:
        port = int(m.group(2))
        if port == 0:
            return endpoint
        if port + size - 1 > 65535:
            raise ConfigError(f"{key} = {endpoint!r}: with runner.dp_size = {size} the ranks bind ports {port}.."
                              f"{port + size - 1}, past 65535; choose a base port at most {65536 - size}")
        return f"{m.group(1)}:{port + rank}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint if rank == 0 else f"{endpoint}-dp{rank}"
    return endpoint


def rank_port(key: str, port: int, rank: int, size: int) -> int:
    return int(rank_endpoint(key, f"tcp://h:{port}", rank, size).rsplit(":", 1)[1])


def _rank_dir(path: str, rank: int, size: int) -> str:
    return str(Path(path) / f"dp{rank}") if path and size > 1 else path


def for_rank(cfg: Config, rank: int, size: int) -> Config:
    """The runner config of DP rank `rank` of `size`, from the engine's one config (the base)."""
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"DP rank {rank} of {size}: need 0 <= rank < size")
    r, e = cfg.runner, cfg.events
    runner = replace(r, dp_rank=rank, dp_size=size, state_dir=_rank_dir(r.state_dir, rank, size),
                     control_endpoint=rank_endpoint("runner.control_endpoint", r.control_endpoint, rank, size),
                     http_port=rank_port("runner.http_port", r.http_port, rank, size))
    events = replace(e, endpoint=rank_endpoint("events.endpoint", e.endpoint, rank, size),
                     replay_endpoint=rank_endpoint("events.replay_endpoint", e.replay_endpoint, rank, size),
                     engine_endpoint=rank_endpoint("events.engine_endpoint", e.engine_endpoint, rank, size),
                     engine_replay_endpoint=rank_endpoint("events.engine_replay_endpoint", e.engine_replay_endpoint,
                                                          rank, size))
    nvme = replace(cfg.nvme, storage_dir=_rank_dir(cfg.nvme.storage_dir, rank, size))
    return replace(cfg, runner=runner, events=events, nvme=nvme)


def default_route_address() -> str:
    """This host's address on its default route (no packet is sent), else its name."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routing only
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def advertised(endpoint: str, host: str) -> str:
    """A bound endpoint (tcp://H:P or http://H:P) as others should dial it: a wildcard H becomes `host`."""
    m = re.fullmatch(r"(\w+)://(.+):(\d+)(/.*)?", endpoint or "")
    if not m or m.group(2) not in WILDCARD_HOSTS:
        return endpoint
    return f"{m.group(1)}://{host}:{m.group(3)}{m.group(4) or ''}"
