"""One typed runner config, decoded once from TOML or JSON with strict validation.

Every error names the key and the value it got. Sizes accept "64Ki", "8Gi", "1.5G" or integers.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args, get_origin, get_type_hints

from .proto.keys import EVENT_FORMATS, KeyFormatError, Namespace

if TYPE_CHECKING:
    from .curve_keys import DeploymentKeys


WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")
MAX_INLINE_PULL_BYTES = 64 << 20  # an inline answer is copied on the source's control thread
# Where a claim's answer carrying the bytes beat claim + GETs + release on loopback TCP (docs/peer.md)
DEFAULT_INLINE_PULL_BYTES = 128 << 10


class ConfigError(ValueError):
    pass


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class Size(int):
    """Bytes; written in config as an integer or a string such as "256Mi"."""


def parse_size(key: str, raw: Any) -> Size:
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
        return Size(raw)
    match = _SIZE.match(raw) if isinstance(raw, str) else None
    if not match:
        raise ConfigError(f"{key} = {raw!r} is not a size (examples: 65536, \"64Ki\", \"8Gi\")")
    number, unit = match.groups()
    return Size(int(float(number) * _UNITS[unit.lower() if unit else None]))


def _parse_bool(key: str, raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise ConfigError(f"{key} = {raw!r} must be true or false")
    return raw


def _parse_int(key: str, raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(f"{key} = {raw!r} must be an integer")
    return raw


def _parse_float(key: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ConfigError(f"{key} = {raw!r} must be a number")
    return float(raw)


def _parse_str(key: str, raw: Any) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"{key} = {raw!r} must be a string")
    return raw


_SCALARS = {bool: _parse_bool, int: _parse_int, float: _parse_float, str: _parse_str, Size: parse_size}


def _decode(cls: type, key: str, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{key or 'config'} must be a table, got {raw!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    for unknown in sorted(set(raw) - names, key=repr):  # keys of any type: named, not compared
        raise ConfigError(f"unknown key {_join(key, unknown) or repr(unknown)} = {raw[unknown]!r}")
    values = {}
    for name in names & set(raw):
        values[name] = _decode_value(hints[name], _join(key, name), raw[name])
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{key or 'config'}: {exc}") from None


def _decode_value(tp: Any, key: str, raw: Any) -> Any:
    if get_origin(tp) is tuple:
        item = get_args(tp)[0]
        if not isinstance(raw, list):
            raise ConfigError(f"{key} = {raw!r} must be a list")
        return tuple(_decode_value(item, f"{key}[{i}]", v) for i, v in enumerate(raw))
    if is_dataclass(tp):
        return _decode(tp, key, raw)
    return _SCALARS[tp](key, raw)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    name: str = "kv"
    page_bytes: Size = Size(64 * 1024)
    size: Size = Size(0)  # 0: the rest of dram.size
    shards: int = 1       # TP shards per page, written by each rank of a sidecar's engine


@dataclass(frozen=True, slots=True, kw_only=True)
class DramConfig:
    size: Size = Size(256 * 2**20)
    lock_memory: bool = False
    alignment: Size = Size(4096)
    high_watermark: float = 1.0
    low_watermark: float = 0.95
    max_claim_fraction: float = 0.5
    pools: tuple[PoolConfig, ...] = (PoolConfig(),)


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceConfig:
    model: str = "default"
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    is_mla: bool = False
    layout: str = "page_first"
    dtype: str = "float16"
    cp_size: int = 1
    cp_rank: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class EventsConfig:
    endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str = "tcp://127.0.0.1:0"
    topic: str = ""
    buffer_steps: int = 10_000
    queue_size: int = 100_000
    event_format: str = "default"
    heartbeat_s: float = 1.0
    engine_endpoint: str = ""
    engine_replay_endpoint: str = ""
    # A relayed engine block is shown once we hold its page too, or after this long (0: at once).
    engine_hold_s: float = 5.0
    plain: bool = False  # no CURVE on events and replay even with keys: for consumers that hold none


@dataclass(frozen=True, slots=True, kw_only=True)
class NvmeConfig:
    storage_dir: str = ""          # empty: no NVMe tier
    max_size: Size = Size(0)       # 0: bounded only by min_free_space
    min_free_space: Size = Size(0)
    high_watermark: float = 1.0
    low_watermark: float = 0.9
    read_workers: int = 4
    write_workers: int = 2
    fsync: bool = False
    write_policy: str = "write_behind"  # or "spill": write a page only when DRAM evicts it
    dirty_wait_s: float = 1.0      # a fill that only dirty pages can make room for waits this long, then drops
    flush_timeout_s: float = 10.0  # at shutdown, dirty pages are written for at most this long
    write_batch: int = 64          # pages per persister batch
    promote: bool = True           # an NVMe hit is copied into DRAM before it is served
    stale_temp_age_s: float = 600.0
    verify: str = "first_read"     # digest check: first read of each file, every read, or never


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerConfig:
    name: str = "kvcr"
    dp_rank: int = 0
    # The engine's DP ranks when > 1: the configured ports are the group's base, each rank's runner
    # binds them + dp_rank (kvcr/ranks.py). 1: a runner alone, whatever its dp_rank.
    dp_size: int = 1
    block_size: int = 16
    state_dir: str = ""
    lease_seconds: float = 10.0
    max_claims_per_peer: int = 64
    ucx: bool = True               # serve peers over UCX (register the DRAM region) and pull from them
    pull_timeout_s: float = 5.0
    pull_abandon_s: float = 5.0
    control_timeout_s: float = 2.0     # a peer's answer to info and claim requests
    unreachable_backoff_s: float = 5.0  # a peer that did not answer is skipped this long (doubling, x16 at most)
    reach_probe_s: float = 0.25    # meanwhile it is probed this often, and the first answer ends the back-off
    peers: tuple[str, ...] = ()    # control endpoints this runner may pull from; ("*",) = any
    verify_transfer_bytes: bool = False  # check an xxh3 digest of every pulled page
    transfer: str = "get"          # "get" (UCX RMA), "tag" (two-sided fallback), "shm" or "auto" (same host)
    pull_lanes: int = 1            # GET workers/threads a large pull is split over
    copy_threads: int = 0          # same-host copies: threads a large pull is split over (0: one per core, <= 4)
    local_control: bool = True     # serve, and ask, same-host peers over a Unix socket (mode 0600) too
    reply_spin_us: int = 500       # a puller first waits for a peer's claim reply this long without sleeping
    # A claim of at most this many bytes takes its pages in the answer (one round trip, no GETs):
    # what a puller asks of sources it does not copy from on this host, and the most a source sends
    # that way. 0: never (docs/peer.md, "Small pulls").
    inline_pull_bytes: Size = Size(DEFAULT_INLINE_PULL_BYTES)
    # ZMQ CURVE on the control socket: a deployment keypair (z85), used by every runner as server
    # and as client. Peers without it get no answer at all. Empty: no authentication.
    curve_public_key: str = ""
    curve_secret_key: str = ""
    curve_allowed_clients: tuple[str, ...] = ()  # more client public keys (e.g. a router's)
    hint_ttl_s: float = 30.0
    max_hinted_hashes: int = 1_000_000
    control_endpoint: str = "tcp://127.0.0.1:0"
    http_host: str = "127.0.0.1"
    http_port: int = 0
    # The host published for an endpoint bound to a wildcard (0.0.0.0, *, ::); "": this host's
    # address on its default route.
    advertise_host: str = ""
    http_token: str = ""           # /info needs `Authorization: Bearer <token>` (required off loopback)
    keys_dir: str = ""             # `kvcr keys init DIR`: CURVE keypair and token from files (docs/security.md)
    # A control socket or /info reachable from other hosts must authenticate (CURVE, a token);
    # true accepts, by name, that anyone who reaches them can read and write pages.
    insecure: bool = False
    ucx_interface: str = ""        # the device UCX listens and connects on (UCX_NET_DEVICES); "": UCX's choice


@dataclass(frozen=True, slots=True)
class CurveKeys:
    public: bytes
    secret: bytes
    allowed: frozenset[bytes]
    server: bytes = b""     # a client with its own keypair: the deployment key it talks to (b"": ours)
    keys_dir: str = ""      # a runner: also admit the client keys under keys_dir/clients (re-read as they change)

    @property
    def server_key(self) -> bytes:
        return self.server or self.public

    @classmethod
    def from_env(cls) -> "CurveKeys | None":
        """A client's deployment keypair from KVCR_CURVE_PUBLIC_KEY / KVCR_CURVE_SECRET_KEY, or
        from the key directory KVCR_KEYS_DIR names (the router, the CLI): None when none is set."""
        public, secret = os.environ.get(ENV_PUBLIC, ""), os.environ.get(ENV_SECRET, "")
        if not public and not secret and os.environ.get(ENV_KEYS_DIR):
            from .curve_keys import KeysError, load

            try:
                keys = load(os.environ[ENV_KEYS_DIR])
            except KeysError as exc:
                raise ConfigError(f"{ENV_KEYS_DIR}: {exc}") from None
            public, secret, server = keys.curve_public, keys.curve_secret, keys.server_public
        else:
            server = ""
        if not public and not secret:
            return None
        for name, value in ((ENV_PUBLIC, public), (ENV_SECRET, secret)):
            _require(len(value) == 40, f"{name} must be a 40-character Z85 CURVE key (set both or neither)")
        return cls(public.encode(), secret.encode(), frozenset(), server.encode())


ENV_PUBLIC, ENV_SECRET, ENV_KEYS_DIR = "KVCR_CURVE_PUBLIC_KEY", "KVCR_CURVE_SECRET_KEY", "KVCR_KEYS_DIR"


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    namespace: NamespaceConfig = field(default_factory=NamespaceConfig)
    dram: DramConfig = field(default_factory=DramConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)

    def __post_init__(self) -> None:
        _validate(self)

    def namespace_for(self, pool: PoolConfig) -> Namespace:
        ns = self.namespace
        try:
            return Namespace(model=ns.model, tp_size=ns.tp_size, tp_rank=ns.tp_rank, pp_size=ns.pp_size,
                             pp_rank=ns.pp_rank, is_mla=ns.is_mla, layout=ns.layout, dtype=ns.dtype,
                             cp_size=ns.cp_size, cp_rank=ns.cp_rank,
                             page_size=self.runner.block_size, components=((pool.name, pool.page_bytes),))
        except KeyFormatError as exc:
            raise ConfigError(str(exc)) from None

    def curve(self) -> CurveKeys | None:
        """The deployment keypair: the config's keys, else runner.keys_dir's (read now, so a
        missing file is refused when the runner starts, by its path), else none."""
        r = self.runner
        public, secret = r.curve_public_key, r.curve_secret_key
        if not public and r.keys_dir:
            keys = self._keys_dir()
            if keys.server_public:
                raise ConfigError(f"runner.keys_dir {r.keys_dir} is a client's key directory (it holds "
                                  "server.public): give runners the deployment's (`kvcr keys init`)")
            public, secret = keys.curve_public, keys.curve_secret
        if not public:
            return None
        return CurveKeys(public.encode(), secret.encode(),
                         frozenset({public.encode(), *(k.encode() for k in r.curve_allowed_clients)}),
                         keys_dir=r.keys_dir)

    def http_token(self) -> str:
        return self.runner.http_token or (self._keys_dir().http_token if self.runner.keys_dir else "")

    def _keys_dir(self) -> DeploymentKeys:
        from .curve_keys import KeysError, load

        try:
            return load(self.runner.keys_dir)
        except KeysError as exc:
            raise ConfigError(f"runner.keys_dir: {exc}") from None

    @property
    def secured(self) -> bool:
        """CURVE keys configured (inline or through runner.keys_dir)."""
        return bool(self.runner.curve_public_key or self.runner.keys_dir)

    @property
    def events_curve(self) -> bool:
        """Events and replay speak CURVE: whenever the runner has keys, unless `events.plain`."""
        return self.secured and not self.events.plain

    @property
    def page_digests(self) -> bool:
        """Digest each page at commit and check pulled pages against the source's digests: asked
        for, and always with CURVE on (a page changed behind the runner's back is never delivered)."""
        return self.runner.verify_transfer_bytes or self.secured

    def pool_sizes(self) -> dict[str, int]:
        """Bytes per pool; a pool with size 0 takes what the others leave of dram.size."""
        fixed = sum(p.size for p in self.dram.pools)
        rest = [p for p in self.dram.pools if p.size == 0]
        share = (self.dram.size - fixed) // max(1, len(rest))
        return {p.name: p.size or share for p in self.dram.pools}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _off_host(endpoint_or_host: str) -> bool:
    """Whether a tcp:// endpoint (or a bare host) is reachable from other hosts: not loopback, not ipc."""
    m = re.fullmatch(r"tcp://(.+):\d+", endpoint_or_host)
    host = m.group(1) if m else "" if "://" in endpoint_or_host else endpoint_or_host
    return bool(host) and host.strip("[]") not in ("localhost", "::1") and not host.startswith("127.")


def _validate_exposure(r: RunnerConfig) -> None:
    if r.insecure:
        return
    _require(not _off_host(r.control_endpoint) or bool(r.curve_public_key or r.keys_dir),
             f"runner.control_endpoint = {r.control_endpoint!r} is reachable from other hosts, and its answers let "
             "a client read and write pages: set runner.curve_public_key/curve_secret_key (docs/security.md), "
             "or runner.insecure = true to accept that")
    _require(not _off_host(r.http_host) or bool(r.http_token or r.keys_dir),
             f"runner.http_host = {r.http_host!r} is reachable from other hosts: set runner.http_token "
             "(docs/security.md), or runner.insecure = true to accept an open /info")


def check_hint_sources(cfg: Config, front_host: str) -> None:
    """A front that takes hints (a worker's HTTP server) reachable from other hosts lets any client
    name the source to pull from: with runner.peers = "*" and no CURVE keys, a stranger's runner
    could then put its bytes under our keys. Refused unless keys or runner.insecure say otherwise."""
    r = cfg.runner
    _require(r.insecure or cfg.secured or "*" not in r.peers or not _off_host(front_host),
             f"this front listens on {front_host!r}, reachable from other hosts, and runner.peers = \"*\" "
             "pulls from whatever source a request's hint names: set runner.keys_dir (docs/security.md) so "
             "only runners holding the deployment keys answer, list the trusted peers in runner.peers, or "
             "set runner.insecure = true to accept that")


def _validate(cfg: Config) -> None:
    d, r, e = cfg.dram, cfg.runner, cfg.events
    _require(r.block_size >= 1, f"runner.block_size = {r.block_size} must be >= 1")
    _require(r.dp_rank >= 0, f"runner.dp_rank = {r.dp_rank} must be >= 0")
    _require(r.dp_size >= 1 and (r.dp_size == 1 or r.dp_rank < r.dp_size),
             f"runner.dp_size = {r.dp_size} must be >= 1, and above runner.dp_rank = {r.dp_rank} when > 1")
    _require(not r.advertise_host or r.advertise_host not in WILDCARD_HOSTS and bool(
             re.fullmatch(r"[A-Za-z0-9_.-]+|(\[)?[0-9A-Fa-f]*:[0-9A-Fa-f]*:[0-9A-Fa-f:.]*(?(1)\])", r.advertise_host)),
             f"runner.advertise_host = {r.advertise_host!r} must be a host name or an address (IPv6 bare or in "
             "brackets), with no scheme, port or wildcard")
    _require(r.lease_seconds > 0, f"runner.lease_seconds = {r.lease_seconds} must be > 0")
    _require(not (r.keys_dir and r.curve_public_key), "set runner.keys_dir or runner.curve_public_key, not both")
    _require(bool(r.curve_public_key) == bool(r.curve_secret_key),
             "runner.curve_public_key and runner.curve_secret_key must be set together")
    for key, value in (("runner.curve_public_key", r.curve_public_key), ("runner.curve_secret_key", r.curve_secret_key),
                       *((f"runner.curve_allowed_clients[{i}]", k) for i, k in enumerate(r.curve_allowed_clients))):
        _require(not value or len(value) == 40, f"{key} must be a 40-character Z85 CURVE key")
    _require(1 <= r.pull_lanes <= 16, f"runner.pull_lanes = {r.pull_lanes} must be in 1..16")
    _require(0 <= r.copy_threads <= 64, f"runner.copy_threads = {r.copy_threads} must be in 0..64 (0: one per core)")
    _require(r.transfer in ("get", "tag", "shm", "auto"),
             f"runner.transfer = {r.transfer!r} must be one of get, tag, shm, auto")
    _require(0 <= r.reach_probe_s <= 60, f"runner.reach_probe_s = {r.reach_probe_s} must be in 0..60 (0: no probes)")
    _require(0 <= r.reply_spin_us <= 100_000, f"runner.reply_spin_us = {r.reply_spin_us} must be in 0..100000")
    _require(0 <= r.inline_pull_bytes <= MAX_INLINE_PULL_BYTES,
             f"runner.inline_pull_bytes = {r.inline_pull_bytes} must be in 0..{MAX_INLINE_PULL_BYTES} (0: never)")
    _require(r.max_claims_per_peer >= 0, f"runner.max_claims_per_peer = {r.max_claims_per_peer} must be >= 0")
    _require(r.pull_timeout_s > 0 and r.pull_abandon_s > 0,
             f"runner.pull_timeout_s = {r.pull_timeout_s} / runner.pull_abandon_s = {r.pull_abandon_s} must be > 0")
    _require(r.control_timeout_s > 0 and r.unreachable_backoff_s > 0,
             f"runner.control_timeout_s = {r.control_timeout_s} / runner.unreachable_backoff_s = "
             f"{r.unreachable_backoff_s} must be > 0")
    _require(0 <= r.http_port < 65536, f"runner.http_port = {r.http_port} is not a port")
    _require(not r.http_token or len(r.http_token) >= 16, "runner.http_token must be at least 16 characters")
    _require(bool(re.fullmatch(r"[A-Za-z0-9_.:-]*", r.ucx_interface)),
             f"runner.ucx_interface = {r.ucx_interface!r} is not a device name (e.g. eth0, or mlx5_0:1)")
    _require(d.alignment > 0 and d.alignment & (d.alignment - 1) == 0,
             f"dram.alignment = {d.alignment} must be a power of two")
    _require(0 < d.low_watermark <= d.high_watermark <= 1,
             f"dram.low_watermark = {d.low_watermark} / dram.high_watermark = {d.high_watermark}: "
             "need 0 < low <= high <= 1")
    _require(0 < d.max_claim_fraction <= 1, f"dram.max_claim_fraction = {d.max_claim_fraction} must be in (0, 1]")
    _require(len(d.pools) >= 1, "dram.pools must name at least one pool")
    names = [p.name for p in d.pools]
    _require(len(set(names)) == len(names), f"dram.pools has a duplicate name in {names}")
    for i, p in enumerate(d.pools):
        _require(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", p.name)),
                 f"dram.pools[{i}].name = {p.name!r} may use only letters, digits, '_', '.', '-'")
        _require(p.page_bytes > 0, f"dram.pools[{i}].page_bytes = {p.page_bytes} must be > 0")
        _require(p.shards >= 1 and p.page_bytes % p.shards == 0,
                 f"dram.pools[{i}].shards = {p.shards} must be >= 1 and divide page_bytes = {p.page_bytes}")
    fixed = sum(p.size for p in d.pools)
    _require(fixed <= d.size, f"dram.pools sizes add up to {fixed} bytes, more than dram.size = {d.size}")
    sizes = cfg.pool_sizes()
    for i, p in enumerate(d.pools):
        _require(sizes[p.name] >= p.page_bytes, f"dram.pools[{i}] ({p.name!r}) gets {sizes[p.name]} bytes, "
                 f"less than one page of {p.page_bytes} bytes; raise dram.size or dram.pools[{i}].size")
    _require(e.event_format in EVENT_FORMATS, f"events.event_format = {e.event_format!r} must be one of "
             f"{EVENT_FORMATS}")
    _require(e.buffer_steps >= 1, f"events.buffer_steps = {e.buffer_steps} must be >= 1")
    _require(e.heartbeat_s >= 0, f"events.heartbeat_s = {e.heartbeat_s} must be >= 0 (0 disables it)")
    _require(0 <= e.engine_hold_s <= 600, f"events.engine_hold_s = {e.engine_hold_s} must be in 0..600 "
             "(0 shows engine blocks at once)")
    _require(e.queue_size >= 1, f"events.queue_size = {e.queue_size} must be >= 1")
    endpoints = [("events.endpoint", e.endpoint), ("events.replay_endpoint", e.replay_endpoint),
                 ("runner.control_endpoint", r.control_endpoint)]
    endpoints += [(k, v) for k, v in (("events.engine_endpoint", e.engine_endpoint),
                                      ("events.engine_replay_endpoint", e.engine_replay_endpoint)) if v]
    for key, value in endpoints:
        _require(bool(re.fullmatch(r"(tcp://[^\s/]+:\d+|ipc://\S+|inproc://\S+)", value)),
                 f"{key} = {value!r} must be a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)")
    _validate_exposure(r)
    _require(not e.engine_replay_endpoint or bool(e.engine_endpoint),
             "events.engine_replay_endpoint is set but events.engine_endpoint is not")
    _require(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", r.name)),
             f"runner.name = {r.name!r} may use only letters, digits, '_', '.', '-' (it names files)")
    for p in d.pools:
        cfg.namespace_for(p)
    n = cfg.nvme
    _require(0 < n.low_watermark <= n.high_watermark <= 1,
             f"nvme.low_watermark = {n.low_watermark} / nvme.high_watermark = {n.high_watermark}: "
             "need 0 < low <= high <= 1")
    _require(n.read_workers >= 1, f"nvme.read_workers = {n.read_workers} must be >= 1")
    _require(n.write_workers >= 1, f"nvme.write_workers = {n.write_workers} must be >= 1")
    _require(n.verify in ("first_read", "always", "never"),
             f"nvme.verify = {n.verify!r} must be one of first_read, always, never")
    _require(n.stale_temp_age_s >= 0, f"nvme.stale_temp_age_s = {n.stale_temp_age_s} must be >= 0")
    _require(n.write_policy in ("write_behind", "spill"),
             f"nvme.write_policy = {n.write_policy!r} must be write_behind or spill")
    for key, value in (("dirty_wait_s", n.dirty_wait_s), ("flush_timeout_s", n.flush_timeout_s)):
        _require(value >= 0, f"nvme.{key} = {value} must be >= 0")
    _require(n.write_batch >= 1, f"nvme.write_batch = {n.write_batch} must be >= 1")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read TOML (.toml) or JSON; `overrides` maps dotted keys to values applied on top."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text: {exc}") from None
        try:
            raw = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: not valid {'JSON' if str(path).endswith('.json') else 'TOML'}: {exc}") \
                from None
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        return _decode(Config, "", raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path is not None else str(exc)) from None
