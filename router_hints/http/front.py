"""What the router does to a request body, and the load it books per worker (pure)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from ..index import Worker
from ..scoring import Load

CLIENT_HINT_KEYS = ("kv_hint", "kv_hints", "router_hint")


def strip_client_hints(body: dict) -> tuple[dict, int]:
    """A copy of `body` without any hint a client put in it, and how many were removed.

    A client must never point a worker at an endpoint of its choosing."""
    out = copy.copy(body)
    removed = sum(out.pop(k, None) is not None for k in CLIENT_HINT_KEYS)
    params = out.get("kv_transfer_params")
    if isinstance(params, dict):
        params = {k: v for k, v in params.items() if k not in CLIENT_HINT_KEYS}
        removed += len(out["kv_transfer_params"]) - len(params)
        out["kv_transfer_params"] = params
    sampling = out.get("sampling_params")
    extra = sampling.get("extra_args") if isinstance(sampling, dict) else None
    nested = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    if isinstance(nested, dict):
        kept = {k: v for k, v in nested.items() if k not in CLIENT_HINT_KEYS}
        removed += len(nested) - len(kept)
        out["sampling_params"] = {**sampling, "extra_args": {**extra, "kv_transfer_params": kept}}
    return out, removed


def attach_hint(body: dict, envelope: dict) -> dict:
    """SGLang's /generate (and `kvcr worker`) take the envelope as `kv_hints`."""
    return {**body, "kv_hints": envelope}


@dataclass(slots=True)
class Booking:
    """One request's share of a worker's load: prefill blocks until its first token, then decode."""

    worker: Worker
    prompt_tokens: int
    new_blocks: int   # blocks the worker must compute (request blocks minus the cached prefix)
    decode_blocks: int
    prefilled: bool = False


def book(loads: dict[Worker, Load], b: Booking) -> None:
    cur = loads.get(b.worker, Load())
    loads[b.worker] = replace(cur, active_prefill_tokens=cur.active_prefill_tokens + b.prompt_tokens,
                              active_prefill_blocks=cur.active_prefill_blocks + b.new_blocks,
                              active_requests=cur.active_requests + 1)


def prefill_done(loads: dict[Worker, Load], b: Booking) -> None:
    b.prefilled = True
    cur = loads[b.worker]
    loads[b.worker] = replace(cur, active_prefill_tokens=cur.active_prefill_tokens - b.prompt_tokens,
                              active_prefill_blocks=cur.active_prefill_blocks - b.new_blocks,
                              potential_decode_blocks=cur.potential_decode_blocks + b.decode_blocks)


def finished(loads: dict[Worker, Load], b: Booking) -> None:
    if not b.prefilled:
        prefill_done(loads, b)
    cur = loads[b.worker]
    loads[b.worker] = replace(cur, potential_decode_blocks=cur.potential_decode_blocks - b.decode_blocks,
                              active_requests=cur.active_requests - 1)
