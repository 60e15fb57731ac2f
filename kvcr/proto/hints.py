"""Router hints: the `kv_hint` envelope Dynamo emits, parsed and built in one place.

Rules follow kvcr 0.1.1 (the reference consumer): first kv.fetch action wins, a version
mismatch only warns, block_hashes are non-empty u64s, mode is "copy" (or our "move").
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from .keys import U64_MASK

PROTOCOL_VERSION = "0.1"
ACTION_TYPE = "kv.fetch"
ACTION_VERSION = "1.0"
MODES = ("copy", "move")


class HintError(ValueError):
    """A hint that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchHint:
    source_control_endpoint: str
    block_hashes: tuple[int, ...]
    mode: str = "copy"
    warnings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.source_control_endpoint, str) or not self.source_control_endpoint:
            raise HintError("source_control_endpoint must be a non-empty string")
        _require_u64_list(self.block_hashes)
        if self.mode not in MODES:
            raise HintError(f"mode must be one of {MODES}, got {self.mode!r}")


def _require_u64_list(values: Any) -> None:
    if not isinstance(values, (list, tuple)) or not values:
        raise HintError("block_hashes must be a non-empty list of integers")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= U64_MASK:
            raise HintError(f"block_hashes entries must be integers in [0, 2^64), got {v!r}")


def _payload_hint(payload: Any, warnings: list[str], allow_move: bool) -> FetchHint:
    if not isinstance(payload, dict):
        raise HintError("kv.fetch payload must be an object")
    if payload.get("no_retain"):
        raise HintError("no_retain hints are not supported")
    if "source_control_endpoint" not in payload:
        raise HintError("hint has no source_control_endpoint (source-less hints are not supported)")
    mode = payload.get("mode", "copy")
    if mode == "move" and not allow_move:
        raise HintError("mode 'move' is not accepted by this consumer")
    hashes = payload.get("block_hashes")
    _require_u64_list(hashes)
    return FetchHint(source_control_endpoint=payload["source_control_endpoint"], block_hashes=tuple(hashes),
                     mode=mode, warnings=tuple(warnings))


def parse_envelope(obj: Any, *, allow_move: bool = False) -> FetchHint:
    """Parse a `kv_hint` envelope (or the flat legacy `router_hint` form)."""
    if not isinstance(obj, dict):
        raise HintError(f"a hint must be an object, got {type(obj).__name__}")
    if "actions" not in obj and "source_control_endpoint" in obj:
        return _payload_hint(obj, [], allow_move)
    warnings = []
    if obj.get("protocol_version") != PROTOCOL_VERSION:
        warnings.append(f"protocol_version {obj.get('protocol_version')!r} != {PROTOCOL_VERSION!r}")
    actions = obj.get("actions")
    if not isinstance(actions, list):
        raise HintError("hint envelope has no actions list")
    for action in actions:
        if isinstance(action, dict) and action.get("action_type") == ACTION_TYPE:
            if action.get("action_version") != ACTION_VERSION:
                warnings.append(f"action_version {action.get('action_version')!r} != {ACTION_VERSION!r}")
            return _payload_hint(action.get("payload"), warnings, allow_move)
    raise HintError("hint envelope has no kv.fetch action")


def extract_request_hint(body: dict) -> Any | None:
    """The raw hint a request body carries, in any of the forms engines accept."""
    for key in ("kv_hint", "kv_hints"):
        if body.get(key) is not None:
            return body[key]
    params = body.get("kv_transfer_params") or {}
    if isinstance(params, dict):
        if params.get("kv_hint") is not None:
            return params["kv_hint"]
        if params.get("router_hint") is not None:
            return params["router_hint"]
    sampling = body.get("sampling_params")
    extra = sampling.get("extra_args") if isinstance(sampling, dict) else None
    nested = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    if isinstance(nested, dict) and nested.get("kv_hint") is not None:
        return nested["kv_hint"]
    return None


def build_envelope(source_control_endpoint: str, block_hashes: Iterable[int], *, mode: str = "copy",
                   message_id: str | None = None) -> dict[str, Any]:
    hint = FetchHint(source_control_endpoint=source_control_endpoint,
                     block_hashes=tuple(h & U64_MASK for h in block_hashes), mode=mode)
    return {"protocol_version": PROTOCOL_VERSION, "message_id": message_id or uuid.uuid4().hex,
            "actions": [{"action_id": "a1", "action_type": ACTION_TYPE, "action_version": ACTION_VERSION,
                         "payload": {"source_control_endpoint": hint.source_control_endpoint,
                                     "block_hashes": list(hint.block_hashes), "mode": hint.mode}}]}


WORKER_TYPES = ("aggregated", "prefill", "decode")


# The runtime-data key under which a kvcr bridge advertises its worker entry in Dynamo's discovery
# (a kvcr router watching it routes there).
KVCR_WORKER_KEY = "kvcr_worker"


def dynamo_advertisement(control_endpoints: dict[int, str], worker_type: str = "aggregated") -> dict[str, Any]:
    """The runtime-config keys a Dynamo worker advertises to be named as a hint source, from its
    runners' control endpoints per global DP rank."""
    if worker_type not in WORKER_TYPES:
        raise HintError(f"worker_type must be one of {WORKER_TYPES}, got {worker_type!r}")
    if not control_endpoints:
        raise HintError("a source needs at least one control endpoint")
    for rank, endpoint in control_endpoints.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise HintError(f"DP ranks are non-negative integers, got {rank!r}")
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
            raise HintError(f"rank {rank}: control endpoint {endpoint!r} is not a ZMQ endpoint")
    return {"router_hint": True, "router_hint_worker_type": worker_type,
            "router_hint_source_control_endpoints": {str(r): e for r, e in sorted(control_endpoints.items())}}
