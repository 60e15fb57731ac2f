"""KV inventory events on the wire: vLLM field names, msgpack, as Dynamo's indexer reads them.

A batch travels as three ZMQ frames [topic, seq u64 BE, msgpack([ts, events, dp_rank])].
Events are maps whose first key is "type"; the older positional form is decoded too.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import msgpack

from .keys import U64_MASK

# Tier names an unmodified Dynamo 1.6 consumer accepts (case-sensitive); anything else is dropped.
# Dynamo reads CPU_PINNED and CPU_TIER1 both as its host tier; kvcr's routers tell them apart: the
# engine's own host pool (SGLang's L2) is CPU_PINNED, a runner's DRAM pool CPU_TIER1 (docs/events.md).
MEDIUM_GPU = "GPU"
MEDIUM_ENGINE_HOST = "CPU_PINNED"
MEDIUM_DRAM = "CPU_TIER1"
MEDIUM_DISK = "DISK"
KNOWN_MEDIA = frozenset({"GPU", "DEVICE", "CPU", "CPU_PINNED", "CPU_TIER1", "CPU_TIER2", "DISK", "NVME",
                         "STORAGE", "EXTERNAL", "SHARED", "REMOTE", "NETWORK"})
# Media a runner serves to peers (its DRAM and NVMe tiers): only these make a worker a pull source.
RUNNER_MEDIA = frozenset({"CPU_TIER1", "CPU_TIER2", "DISK", "NVME", "STORAGE"})
REPLAY_END_SEQ = b"\xff" * 8
_I64_MIN = -(1 << 63)
_INT_ONLY = {int}


class EventError(ValueError):
    """A frame or event that does not follow the wire format; the message names the problem."""


def require_hash(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not _I64_MIN <= value <= U64_MASK:
        raise EventError(f"{name} must be a 64-bit integer, got {value!r}")
    return value


def _require_hashes(name: str, values: Any) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)) or not values:
        raise EventError(f"{name} must be a non-empty list of integers, got {values!r}")
    # Fast path for the common case (plain ints in range); the slow path names the bad entry.
    if not (set(map(type, values)) == _INT_ONLY and _I64_MIN <= min(values) and max(values) <= U64_MASK):
        for v in values:
            require_hash(name, v)
    return tuple(values)


def _require_medium(value: Any) -> str | None:
    if value is not None and value not in KNOWN_MEDIA:
        raise EventError(f"medium {value!r} is not a tier routers accept ({sorted(KNOWN_MEDIA)})")
    return value


def require_optional_str(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EventError(f"{name} must be a string or nil, got {value!r}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = MEDIUM_DRAM
    lora_name: str | None = None
    cache_salt: str | None = None
    lora_id: None = None  # deprecated in vLLM; always nil on the wire
    # Fields of a relayed engine event that we do not model (group_idx, locality, extra_keys...),
    # written back unchanged so the router applies its own rules to them.
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        _require_hashes("block_hashes", self.block_hashes)
        if self.parent_block_hash is not None:
            require_hash("parent_block_hash", self.parent_block_hash)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise EventError(f"block_size must be a positive integer, got {self.block_size!r}")
        # More tokens are legal (EAGLE pages carry one extra); fewer make the event unusable.
        if len(self.token_ids) < self.block_size * len(self.block_hashes):
            raise EventError(f"token_ids has {len(self.token_ids)} tokens, expected block_size "
                             f"{self.block_size} x {len(self.block_hashes)} blocks")
        if len(set(self.block_hashes)) != len(self.block_hashes):
            raise EventError("block_hashes contains a duplicate")
        if self.parent_block_hash is not None and self.parent_block_hash in self.block_hashes:
            raise EventError("a block cannot be its own parent")
        _require_medium(self.medium)
        require_optional_str("lora_name", self.lora_name)
        require_optional_str("cache_salt", self.cache_salt)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "BlockStored", "block_hashes": list(self.block_hashes),
                               "parent_block_hash": self.parent_block_hash, "token_ids": list(self.token_ids),
                               "block_size": self.block_size, "lora_id": None, "medium": self.medium,
                               "lora_name": self.lora_name}
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        out.update(self.extra)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM_DRAM
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        _require_hashes("block_hashes", self.block_hashes)
        _require_medium(self.medium)

    def to_wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium,
                **dict(self.extra)}


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    def to_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True, kw_only=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    # Reasons for events dropped while decoding (one bad event never costs the whole batch).
    rejected: tuple[str, ...] = field(default=(), compare=False)

    def encode(self) -> bytes:
        return msgpack.packb([self.ts, [e.to_wire() for e in self.events], self.dp_rank], use_bin_type=True)


def encode_seq(seq: int) -> bytes:
    return struct.pack(">Q", seq)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise EventError(f"seq frame must be 8 bytes, got {len(frame)}")
    return struct.unpack(">Q", frame)[0]


def batch_frames(topic: bytes, seq: int, batch: EventBatch) -> list[bytes]:
    return [topic, encode_seq(seq), batch.encode()]


def _as_tuple(value: Any) -> Any:
    # Lists become tuples; anything else is passed on for the dataclass check to name.
    return tuple(value) if isinstance(value, list) else value


_STORED_FIELDS = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "cache_salt")
_REMOVED_FIELDS = ("type", "block_hashes", "medium")


def _extra(raw: dict, known: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in raw.items() if k not in known)


def _event_from_map(raw: dict) -> Event:
    kind = raw.get("type")
    if "ownership" in raw:
        raise EventError("event carries 'ownership', which raw-protocol routers drop")
    try:
        if kind == "BlockStored":
            return BlockStored(block_hashes=_as_tuple(raw["block_hashes"]),
                               parent_block_hash=raw.get("parent_block_hash"),
                               token_ids=_as_tuple(raw["token_ids"]), block_size=raw["block_size"],
                               medium=raw.get("medium"), lora_name=raw.get("lora_name"),
                               cache_salt=raw.get("cache_salt"), extra=_extra(raw, _STORED_FIELDS))
        if kind == "BlockRemoved":
            return BlockRemoved(block_hashes=_as_tuple(raw["block_hashes"]), medium=raw.get("medium"),
                                extra=_extra(raw, _REMOVED_FIELDS))
    except KeyError as exc:
        raise EventError(f"{kind} event lacks field {exc.args[0]!r}") from None
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventError(f"unknown event type {kind!r}")


_POSITIONAL = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                               "kv_cache_spec_sliding_window"),
               "BlockRemoved": ("block_hashes", "medium"),
               "AllBlocksCleared": ()}


def _event_from_list(raw: list) -> Event:
    kind = raw[0] if raw else None
    names = _POSITIONAL.get(kind) if isinstance(kind, str) else None
    if names is None:
        raise EventError(f"unknown positional event type {kind!r}")
    as_map: dict[str, Any] = {"type": kind, **{k: v for k, v in zip(names, raw[1:]) if v is not None}}
    if kind == "BlockStored":
        as_map.setdefault("parent_block_hash", None)
        if isinstance(as_map.get("lora_name"), dict):  # the older form carried {cache_salt} here
            as_map["cache_salt"] = as_map.pop("lora_name").get("cache_salt")
    return _event_from_map(as_map)


def decode_event(raw: Any) -> Event:
    """One event, map or positional form; raises EventError naming the problem."""
    try:
        if isinstance(raw, dict):
            return _event_from_map(raw)
        if isinstance(raw, list):
            return _event_from_list(raw)
    except EventError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:  # fields of the wrong shape
        raise EventError(f"malformed event: {exc}") from None
    raise EventError(f"an event must be a map or an array, got {type(raw).__name__}")


def decode_batch(payload: bytes) -> EventBatch:
    """Decode a batch payload. A malformed frame raises EventError; a malformed event inside a good
    frame is dropped and its reason kept in `rejected`, as a router drops only that event."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise EventError(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) != 3:
        raise EventError("batch must be a 3-element array [ts, events, dp_rank]")
    ts, events, dp_rank = raw
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventError(f"batch ts must be a number, got {ts!r}")
    if not isinstance(events, list):
        raise EventError(f"batch events must be an array, got {type(events).__name__}")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0):
        raise EventError(f"batch dp_rank must be a non-negative int or nil, got {dp_rank!r}")
    good, rejected = [], []
    for item in events:
        try:
            good.append(decode_event(item))
        except EventError as exc:
            rejected.append(str(exc))
    return EventBatch(ts=float(ts), events=tuple(good), dp_rank=dp_rank, rejected=tuple(rejected))


def decode_frames(frames: Sequence[bytes]) -> tuple[bytes, int, EventBatch]:
    if len(frames) != 3:
        raise EventError(f"an event message has 3 frames, got {len(frames)}")
    return frames[0], decode_seq(frames[1]), decode_batch(frames[2])
