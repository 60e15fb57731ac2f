"""Finding publishers through their info endpoints, never by port arithmetic."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass

from kvcr.ranks import dialable


class DiscoveryError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Publisher:
    """What a router needs from one (worker, DP rank): where its events are, and its control socket."""

    worker_id: str
    dp_rank: int
    block_size: int
    events: str
    replay: str | None
    control: str | None  # kvcr runners only: the source endpoint hints name
    role: str = "aggregated"
    events_curve: bool = False  # a kvcr runner with keys: its events and replay speak CURVE


def from_runner_info(worker_id: str, info: dict, *, block_size: int, role: str = "aggregated") -> Publisher:
    """A kvcr runner's info (`kvcr info`, GET /info). A block size other than ours is refused by name."""
    if info.get("block_size") != block_size:
        raise DiscoveryError(f"worker {worker_id}: runner block_size {info.get('block_size')} != router "
                             f"block_size {block_size}")
    ep = info.get("endpoints")
    if not isinstance(ep, dict) or not ep.get("events"):
        raise DiscoveryError(f"worker {worker_id}: runner info has no events endpoint")
    return Publisher(worker_id, int(info.get("dp_rank", 0)), block_size, ep["events"], ep.get("replay"),
                     ep.get("control"), role, info.get("events_curve") is True)


def from_sglang_server_info(worker_id: str, server_info: dict, host: str, *, block_size: int) -> list[Publisher]:
    """SGLang's /server_info `kv_events`: one publisher per DP rank at endpoint_port_base + rank."""
    kv = server_info.get("kv_events")
    if not kv:
        raise DiscoveryError(f"worker {worker_id}: SGLang publishes no KV events (--kv-events-config)")
    if kv.get("block_size") != block_size:
        raise DiscoveryError(f"worker {worker_id}: engine block_size {kv.get('block_size')} != router "
                             f"block_size {block_size}")
    if not isinstance(kv.get("endpoint_port_base"), int):
        raise DiscoveryError(f"worker {worker_id}: kv_events has no endpoint_port_base")
    ev_host = dialable(kv.get("endpoint_host") or "", host)
    replay_base = kv.get("replay_endpoint_port_base")
    return [Publisher(worker_id, rank, block_size, f"tcp://{ev_host}:{kv['endpoint_port_base'] + rank}",
                      f"tcp://{ev_host}:{replay_base + rank}" if replay_base else None, None)
            for rank in range(int(kv.get("dp_size", 1)))]


def fetch_runner(worker_id: str, http_url: str, *, block_size: int, timeout_s: float = 5.0) -> Publisher:
    with urllib.request.urlopen(http_url.rstrip("/") + "/info", timeout=timeout_s) as resp:
        return from_runner_info(worker_id, json.load(resp), block_size=block_size)
