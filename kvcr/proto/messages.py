"""Control-plane messages: typed, versioned, msgpack maps. Decoding validates everything once.

Every message carries the protocol version [major, minor], the sender's incarnation and a
request id; replies echo the id. A peer with another major version is refused by name.
"""

from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar, get_args, get_origin, get_type_hints

import msgpack

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 3  # 2: a release may ask for no answer (`quiet`); 3: a claim may take its bytes inline
CAPABILITIES = ("snapshot", "claims", "fills", "ucx_get", "ucx_tag", "tiers", "move", "posted_hints", "shards",
                "inline_pages")


class ProtocolError(ValueError):
    """A control frame that cannot be accepted; `code` is sent back in the Error reply."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


_REGISTRY: dict[str, type["Message"]] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    TYPE: ClassVar[str] = ""
    request_id: int = 0
    incarnation: str = ""
    version: tuple[int, int] = (PROTOCOL_MAJOR, PROTOCOL_MINOR)

    @property
    def wants_reply(self) -> bool:
        return True


def _msg(cls: type) -> type:
    cls = dataclass(frozen=True, slots=True, kw_only=True)(cls)
    _REGISTRY[cls.TYPE] = cls
    return cls


@_msg
class InfoRequest(Message):
    TYPE = "info"


@_msg
class Info(Message):
    TYPE = "info_reply"
    info: dict = field(default_factory=dict)


@_msg
class SnapshotRequest(Message):
    TYPE = "snapshot"


@_msg
class SnapshotPart(Message):
    """One chunk of the inventory as wire events; `seq` is the last batch the snapshot includes."""

    TYPE = "snapshot_part"
    seq: int = 0
    events: list = field(default_factory=list)
    done: bool = False


@_msg
class Lookup(Message):
    TYPE = "lookup"
    pool: str = "kv"
    keys: list[str] = field(default_factory=list)


@_msg
class LookupReply(Message):
    """`num_ready`: leading pages in DRAM; `tiers`: per key 0 absent, 1 DRAM, 2 NVMe (minor 1+)."""

    TYPE = "lookup_reply"
    num_ready: int = 0
    tiers: list[int] = field(default_factory=list)


@_msg
class Remove(Message):
    """Drop `keys` from every tier; with `everything`, every page of the pool (SGLang's flush)."""

    TYPE = "remove"
    pool: str = "kv"
    keys: list[str] = field(default_factory=list)
    everything: bool = False


@_msg
class Removed(Message):
    TYPE = "removed"
    num_removed: int = 0


@_msg
class SendPages(Message):
    """Two-sided fallback: the source tag-sends claimed pages to the puller's worker `address`.
    `ops`: [[region offset, nbytes, tag]], each inside the claim's pages."""

    TYPE = "send_pages"
    claim_id: int = 0
    address: str = ""
    ops: list[tuple[int, int, int]] = field(default_factory=list)


@_msg
class Sent(Message):
    TYPE = "sent"
    done: list[bool] = field(default_factory=list)


@_msg
class PullRequest(Message):
    """Ask a runner to pull pages it lacks from a trusted peer (the router's or an operator's hint)."""

    TYPE = "pull"
    source_endpoint: str = ""  # empty: the source a posted hint names for these pages
    pool: str = "kv"
    keys: list[str] = field(default_factory=list)
    event_hashes: list[int] = field(default_factory=list)  # the engine's hashes; default: plain SGLang ones


@_msg
class PostHint(Message):
    """A router's `kv_hint` envelope for a request this runner's engine will serve."""

    TYPE = "post_hint"
    envelope: dict = field(default_factory=dict)


@_msg
class HintPosted(Message):
    TYPE = "hint_posted"
    num_hashes: int = 0


@_msg
class Pulled(Message):
    TYPE = "pulled"
    num_local: int = 0  # leading pages now held locally


@_msg
class Persist(Message):
    """Write DRAM pages to the NVMe tier now (write-through)."""

    TYPE = "persist"
    pool: str = "kv"
    keys: list[str] = field(default_factory=list)


@_msg
class Persisted(Message):
    TYPE = "persisted"
    num_persisted: int = 0


@_msg
class Reserve(Message):
    TYPE = "reserve"
    pool: str = "kv"
    keys: list[str] = field(default_factory=list)
    announces: list = field(default_factory=list)  # per key: Announce.to_wire() or nil
    lease_s: float = 0.0
    writer_pid: int = 0  # same-host writer: its fill is not aborted while it lives


@_msg
class Reserved(Message):
    """Region offset per key; -1 where the page is already present (nothing to write)."""

    TYPE = "reserved"
    fill_id: int = 0
    offsets: list[int] = field(default_factory=list)


@_msg
class ReserveShard(Message):
    """A TP rank joins the fill assembling exactly `keys` (opened by the first rank to ask)."""

    TYPE = "reserve_shard"
    pool: str = "kv"
    keys: list[str] = field(default_factory=list)
    shard: int = 0
    announces: list = field(default_factory=list)
    lease_s: float = 0.0


@_msg
class ShardReserved(Message):
    """Per key: the page's region offset (-1 present, -2 being written by another fill), plus
    this shard's offset inside a page."""

    TYPE = "shard_reserved"
    fill_id: int = 0
    offsets: list[int] = field(default_factory=list)
    shard_offset: int = 0


@_msg
class CommitShard(Message):
    TYPE = "commit_shard"
    fill_id: int = 0
    shard: int = 0
    ok: bool = True


@_msg
class ShardCommitted(Message):
    """`verdict`: "committed" (every shard is in), "discarded" (one failed) or "waiting"."""

    TYPE = "shard_committed"
    verdict: str = "waiting"


@_msg
class Commit(Message):
    TYPE = "commit"
    fill_id: int = 0
    ok: list[bool] = field(default_factory=list)


@_msg
class Committed(Message):
    TYPE = "committed"
    num_committed: int = 0


@_msg
class ClaimRequest(Message):
    """`namespace`: the claimer's namespace fields; a mismatch is refused naming both values."""

    TYPE = "claim"
    pool: str = "kv"
    keys: list[str] = field(default_factory=list)
    lease_s: float = 0.0
    namespace: dict = field(default_factory=dict)
    digests: bool = False  # also send an xxh3-64 digest per page, to check the bytes after the GETs
    # Minor 3: when the granted pages come to at most this many bytes, answer with the bytes and end
    # the claim at once (one round trip, no GETs). 0: never; a minor-2 source ignores it and grants.
    inline_max: int = 0


@_msg
class Granted(Message):
    """Region offsets of the claimed pages (NVMe pages are staged into DRAM first), their slot
    generations and announces (so the puller can publish what it received)."""

    TYPE = "granted"
    claim_id: int = 0
    offsets: list[int] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)
    lease_s: float = 0.0
    announces: list = field(default_factory=list)
    digests: list[int] = field(default_factory=list)
    # The granted pages back to back, when the claim asked for them inline: the claim has then
    # already ended at the source (nothing to GET, nothing to release).
    data: bytes = b""


@_msg
class Renew(Message):
    TYPE = "renew"
    claim_id: int = 0


@_msg
class Renewed(Message):
    TYPE = "renewed"
    lease_s: float = 0.0


@_msg
class ReleaseRequest(Message):
    """`drop`: move mode: the puller received this many leading pages intact, so the source drops
    its copies of them (those still live)."""

    TYPE = "release"
    claim_id: int = 0
    drop: int = 0
    # No answer wanted (minor 2): a release nobody waits for. A minor-1 source answers anyway,
    # and the puller's client drops that answer as it reads its next reply.
    quiet: bool = False

    @property
    def wants_reply(self) -> bool:
        return not self.quiet


@_msg
class Released(Message):
    TYPE = "released"
    live: list[bool] = field(default_factory=list)


@_msg
class Error(Message):
    TYPE = "error"
    code: str = ""
    message: str = ""


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def encode(msg: Message, *, request_id: int | None = None, incarnation: str | None = None) -> bytes:
    """The wire form; `request_id` and `incarnation`, when given, stand in for the message's own
    (what a sender stamps on each message, without copying it)."""
    body = {name: getattr(msg, name) for name in _field_names(type(msg))}
    if request_id is not None:
        body["request_id"] = request_id
    if incarnation is not None:
        body["incarnation"] = incarnation
    body["type"] = msg.TYPE
    body["version"] = list(msg.version)
    return msgpack.packb(body, use_bin_type=True)


_CHECKS = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
           float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
           str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool),
           list: lambda v: isinstance(v, list), dict: lambda v: isinstance(v, dict),
           bytes: lambda v: isinstance(v, bytes)}
# The exact types a list of each scalar may hold: one set() over a long list instead of a call per item.
_ITEM_TYPES = {int: frozenset({int}), float: frozenset({int, float}), str: frozenset({str}), bytes: frozenset({bytes}),
               bool: frozenset({bool}), list: frozenset({list}), dict: frozenset({dict})}


class _Mismatch(Exception):
    pass


@functools.lru_cache(maxsize=None)
def _checker(tp: Any) -> Callable[[Any], Any]:
    """A function taking a decoded value to `tp` (a scalar, list[...] or a fixed tuple[...], sent
    as a list), raising _Mismatch to say why not; built once per type, not per message."""
    origin = get_origin(tp)
    if origin is list:
        return _list_checker(*get_args(tp))
    if origin is tuple:
        return _tuple_checker(tuple(_checker(t) for t in get_args(tp)))
    check = _CHECKS[tp]

    def scalar(value: Any) -> Any:
        if not check(value):
            raise _Mismatch(f"got {type(value).__name__}")
        return value
    return scalar


def _list_checker(item: Any) -> Callable[[Any], Any]:
    if item not in _CHECKS:
        conform = _checker(item)

        def nested(value: Any) -> Any:
            if not isinstance(value, list):
                raise _Mismatch(f"got {type(value).__name__}")
            try:
                return [conform(v) for v in value]
            except _Mismatch as exc:
                raise _Mismatch(f"an item: {exc}") from None
        return nested
    allowed, check = _ITEM_TYPES[item], _CHECKS[item]

    def scalars(value: Any) -> Any:  # the common case, checked without rebuilding the list
        if not isinstance(value, list):
            raise _Mismatch(f"got {type(value).__name__}")
        if not allowed.issuperset(map(type, value)):  # subclasses (bool for int) take the slow path
            bad = next((i for i, v in enumerate(value) if not check(v)), None)
            if bad is not None:
                raise _Mismatch(f"item {bad} is {type(value[bad]).__name__}")
        return value
    return scalars


def _tuple_checker(items: tuple[Callable[[Any], Any], ...]) -> Callable[[Any], Any]:
    def fixed(value: Any) -> Any:
        if not (isinstance(value, list) and len(value) == len(items)):
            raise _Mismatch(f"got {value!r}")
        return tuple(conform(v) for conform, v in zip(items, value))
    return fixed


@functools.lru_cache(maxsize=None)
def _schema(cls: type) -> tuple[dict[str, Callable[[Any], Any]], tuple[str, ...]]:
    """Per message type, once: each field's checker, and the fields a message must carry.
    (Resolving string annotations compiles code.)"""
    hints = get_type_hints(cls)
    required = tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
    return {f.name: _checker(hints[f.name]) for f in fields(cls)}, required


def _checked(cls: type, raw: dict) -> dict:
    """The fields of `cls` in `raw`, each checked; unknown fields come from a newer minor version
    and are ignored on purpose."""
    checkers = _schema(cls)[0]
    values = {}
    name = ""
    try:
        for name, value in raw.items():
            check = checkers.get(name)
            if check is not None:
                values[name] = check(value)
    except _Mismatch as exc:
        tp = get_type_hints(cls)[name]
        shown = "[major, minor]" if name == "version" else tp.__name__ if isinstance(tp, type) else str(tp)
        raise ProtocolError(f"{cls.TYPE}.{name} must be {shown}, {exc}") from None
    return values


def decode(payload: bytes) -> Message:
    """Decode and validate one control frame; raises ProtocolError naming the problem."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"a control message must be a map, got {type(raw).__name__}")
    kind = raw.pop("type", None)
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("unknown or missing message type", code="unknown_type")
    values = _checked(cls, raw)
    missing = [n for n in _schema(cls)[1] if n not in values]
    if missing:
        raise ProtocolError(f"{cls.TYPE} lacks {missing}")
    msg = cls(**values)
    if msg.version[0] != PROTOCOL_MAJOR:
        raise ProtocolError(f"protocol major version {msg.version[0]} is not {PROTOCOL_MAJOR}",
                            code="version")
    return msg
