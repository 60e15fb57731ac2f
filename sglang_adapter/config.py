"""The backend's extra-config (the JSON after `--hicache-storage-backend-extra-config`): strict,
and an error names the key. Pure: no SGLang import."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# Keys the dynamic loader reads, and keys SGLang's controller takes out before the backend sees
# the dict (they may still reach it, e.g. from a direct construction): accepted, not ours.
LOADER_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
CONTROLLER_KEYS = frozenset({"prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                             "hicache_storage_pass_prefix_keys", "tp_lcm_size"})


class AdapterConfigError(ValueError):
    pass


def _key(default: Any, meaning: str, *, factory: Any = None) -> Any:
    """A field whose one-line meaning `--help` prints (docs/sglang.md has the long form)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": meaning})
    return field(default=default, metadata={"help": meaning})


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    # Embedded runner (TP = 1): its config file and dotted overrides, as for `kvcr serve`.
    runner_config: str = _key("", "a runner config file (TOML/JSON) the `runner` keys override")
    runner: dict = _key(None, "dotted runner keys, as for `kvcr serve --set` (dram.size, nvme.storage_dir, ...)",
                        factory=dict)
    # Hints: from extra_info (`kv_hints`), or posted to the runner by the router (keyed by block hash).
    use_request_hints: bool = _key(True, "take the source from the request's kv_hints")
    use_posted_hints: bool = _key(True, "take the source from hints the router posted to the runner")
    # SGLang's prefetch can end without telling the backend: a claim made in batch_exists lives
    # this long if batch_get never comes. Default: a 15 s prefetch budget + 1 s.
    claim_lease_s: float = _key(16.0, "how long a claim taken by batch_exists may wait for batch_get")
    pull_timeout_s: float = _key(10.0, "a transfer's deadline before it is cancelled")
    peers: tuple[str, ...] = _key((), "peers' runner endpoints (tcp:// control or http:// info) whose event "
                                      "streams are followed")
    # On by default so that two engines one user starts reuse each other's pages with no list to
    # keep, as SGLang's `file` backend does through its shared directory.
    peers_dir: str = _key("auto", "a directory (only ours) where runners leave their info and find their peers' "
                                  "(auto: $XDG_RUNTIME_DIR/kvcr/peers, else <tmp>/kvcr-<uid>/peers; \"\" off)")
    peers_etcd: str = _key("", "etcd's client URL (http://HOST:2379, Dynamo's will do): runners register "
                               "there, held by a lease, and follow each other across hosts; replaces peers_dir")
    opportunistic: bool = _key(True, "with peers (listed or found): pull from the peer that announced the pages "
                                     "when no hint names a source")
    # TP > 1 or MLA: every rank attaches to this worker's (and DP rank's) sidecar.
    sidecar: str = _key("", "TP > 1 or MLA: the worker's `kvcr serve` sidecar control endpoint "
                            "(class KVCRSidecarStorage)")
    model: str = _key("", "the model name in the namespace when SGLang names none")
    # The launcher gives SGLang a --kv-events-config on a private socket and the runner relays it,
    # so routers see the engine's device and host tiers in the runner's one stream.
    engine_events: bool = _key(True, "relay the engine's own KV events (device and host tiers) through the runner; "
                                     "ignored when --kv-events-config is given")


KEY_TYPES = {"runner_config": str, "runner": dict, "use_request_hints": bool, "use_posted_hints": bool,
             "claim_lease_s": float, "pull_timeout_s": float, "model": str, "peers": list, "peers_dir": str,
             "peers_etcd": str, "opportunistic": bool,
             "sidecar": str, "engine_events": bool}


def _check(key: str, value: Any, tp: type) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
        raise AdapterConfigError(f"kvcr extra-config {key!r} must be {tp.__name__}, got {value!r}")
    return value


def parse_adapter_config(extra: dict | None) -> AdapterConfig:
    extra = dict(extra or {})
    known = {f.name for f in fields(AdapterConfig)}
    for key in extra:
        if key not in known and key not in LOADER_KEYS | CONTROLLER_KEYS:
            raise AdapterConfigError(f"kvcr extra-config has an unknown key {key!r} (known: "
                                     f"{', '.join(sorted(known | LOADER_KEYS | CONTROLLER_KEYS))})")
    values = {k: _check(k, v, KEY_TYPES[k]) for k, v in extra.items() if k in known}
    if "peers" in values:
        bad = [p for p in values["peers"] if not isinstance(p, str) or not p.startswith(("tcp://", "ipc://", "http"))]
        if bad:
            raise AdapterConfigError(f"kvcr extra-config 'peers' entries must be tcp://, ipc:// or http(s):// "
                                     f"endpoints, got {bad[0]!r}")
        values["peers"] = tuple(values["peers"])
    if values.get("peers_etcd") and not values["peers_etcd"].startswith(("http://", "https://")):
        raise AdapterConfigError(f"kvcr extra-config 'peers_etcd' must be etcd's http(s):// client URL, got "
                                 f"{values['peers_etcd']!r}")
    for key in ("claim_lease_s", "pull_timeout_s"):
        if key in values and values[key] <= 0:
            raise AdapterConfigError(f"kvcr extra-config {key!r} must be > 0, got {values[key]}")
    return AdapterConfig(**values)
