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


def rank_port(key: str, value: str | int, port: int, rank: int, size: int) -> int:
    """Rank `rank`'s port from the base `port` (0, an ephemeral port, stays 0); refused naming `key`
    and its `value` when the last rank's would pass 65535."""
    if port == 0:
        return 0
    if port + size - 1 > 65535:
        raise ConfigError(f"{key} = {value!r}: with runner.dp_size = {size} the ranks bind ports {port}.."
                          f"{port + size - 1}, past 65535; choose a base port at most {65536 - size}")
    return port + rank


def rank_endpoint(key: str, endpoint: str, rank: int, size: int) -> str:
    """`endpoint` for `rank` of `size`: a tcp port + rank, an ipc path suffixed -dp<rank>."""
    m = _TCP.fullmatch(endpoint)
    if m:
        return f"{m.group(1)}:{rank_port(key, endpoint, int(m.group(2)), rank, size)}"
    if endpoint.startswith(("ipc://", "inproc://")) and rank:
        return f"{endpoint}-dp{rank}"
    return endpoint


def _rank_dir(path: str, rank: int, size: int) -> str:
    return str(Path(path) / f"dp{rank}") if path and size > 1 else path


def _check_ranges(cfg: Config, size: int) -> None:
    """Each fixed port's ranks take base..base + size - 1: two keys whose ranges meet would make one
    rank's socket another's (events 5557 and replay 5558 at two ranks), so they are refused by name."""
    r, e = cfg.runner, cfg.events
    ports = {key: int(m.group(2)) for key, endpoint in (
        ("runner.control_endpoint", r.control_endpoint), ("events.endpoint", e.endpoint),
        ("events.replay_endpoint", e.replay_endpoint), ("events.engine_endpoint", e.engine_endpoint),
        ("events.engine_replay_endpoint", e.engine_replay_endpoint)) if (m := _TCP.fullmatch(endpoint))}
    ports["runner.http_port"] = r.http_port
    fixed = sorted((port, key) for key, port in ports.items() if port)
    for (low, low_key), (high, high_key) in zip(fixed, fixed[1:]):
        if high < low + size:
            raise ConfigError(f"{low_key} (port {low}) and {high_key} (port {high}): with runner.dp_size = {size} the "
                              f"ranks bind {low}..{low + size - 1} and {high}..{high + size - 1}, which meet; space "
                              f"the base ports at least {size} apart")


def for_rank(cfg: Config, rank: int, size: int) -> Config:
    """The runner config of DP rank `rank` of `size`, from the engine's one config (the base)."""
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"DP rank {rank} of {size}: need 0 <= rank < size")
    if size > 1:
        _check_ranges(cfg, size)
    r, e = cfg.runner, cfg.events
    runner = replace(r, dp_rank=rank, dp_size=size, state_dir=_rank_dir(r.state_dir, rank, size),
                     control_endpoint=rank_endpoint("runner.control_endpoint", r.control_endpoint, rank, size),
                     http_port=rank_port("runner.http_port", r.http_port, r.http_port, rank, size))
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


_BOUND = re.compile(r"(\w+)://(.+):(\d+)(/.*)?")


def is_wildcard(endpoint: str) -> bool:
    m = _BOUND.fullmatch(endpoint or "")
    return bool(m) and m.group(2) in WILDCARD_HOSTS


def dialable(host: str, instead: str) -> str:
    """`host` as a peer dials it: `instead` when it is a wildcard (or empty), an IPv6 address in
    brackets (it goes into tcp://H:P and http://H:P)."""
    if not host or host in WILDCARD_HOSTS:
        host = instead
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def advertised(endpoint: str, host: str) -> str:
    """A bound endpoint (tcp://H:P or http://H:P) as others should dial it: a wildcard H becomes `host`."""
    if not is_wildcard(endpoint):
        return endpoint
    m = _BOUND.fullmatch(endpoint)
    return f"{m.group(1)}://{dialable(m.group(2), host)}:{m.group(3)}{m.group(4) or ''}"
