"""`python -m sglang_adapter.launch_server ...` (or `kvcr sglang ...`): SGLang's own launcher that
also accepts `--hicache-storage-backend kvcr`, and installs kvcr's hooks in every scheduler.

`kvcr` becomes SGLang's `dynamic` backend with kvcr's module, class and zero-copy interface
merged into the extra-config, and prefetch timeouts that leave room for a peer pull. Unless the
operator configures them, the engine's own KV events go to a private socket its runner relays, so
routers see device, host and runner tiers in one stream per worker. `--help` is
SGLang's, with `kvcr` among the storage backends and kvcr's extra-config keys at the end. Once the
engine is down, regions its killed schedulers' runners left in /dev/shm are removed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

from kvcr.config import ConfigError, check_hint_sources, load_config
from kvcr.drivers.shm import sweep_stale

from .config import KEY_TYPES, CONTROLLER_KEYS, AdapterConfig, AdapterConfigError, parse_adapter_config
from .hooks import check_version
from .releases import UnsupportedSGLang

BACKEND_FLAG = "--hicache-storage-backend"
EXTRA_FLAG = "--hicache-storage-backend-extra-config"
EVENTS_FLAG = "--kv-events-config"
DP_FLAGS = ("--dp-size", "--data-parallel-size", "--attn-dp-size", "--attention-data-parallel-size")
DYNAMIC = {"backend_name": "kvcr", "module_path": "sglang_adapter.storage", "class_name": "KVCRStorage",
           "interface_v1": 1}
# bench/sglang_adapter.py (docs/sglang.md): warm 8k/32k-token pulls took 66/156 ms (p99) on one host,
# a first contact with a new peer up to ~0.66 s; a 10 GbE link needs ~0.03 s per 1k tokens of a
# 28-layer model. A 2 s base is about 3x the first contact; SGLang's 0.25 s per 1k tokens stays
# (>= 2x either link). SGLang's 1 s base leaves too little room for a first pull.
TIMEOUTS = {"prefetch_timeout_base": 2.0, "prefetch_timeout_per_ki_token": 0.25}
# prefix keys let a backed-up page name its parent, so its announce continues the chain routers match.
DEFAULTS = {**TIMEOUTS, "hicache_storage_pass_prefix_keys": True}
PROG = "python -m sglang_adapter.launch_server"
HELP_FLAGS = frozenset({"-h", "--help"})
KVCR_CHOICE_HELP = ("kvcr: kvcr's KV-cache reuse backend; the launcher turns it into `dynamic` with kvcr's "
                    "module and class, and installs kvcr's hooks (its extra-config keys are listed at the end).")
_JSON_TYPES = {str: "string", dict: "object", bool: "bool", float: "float", list: "list of strings"}


class LaunchError(ValueError):
    pass


def _flag_value(argv: list[str], flag: str) -> tuple[int, int, str] | None:
    """(index of the flag, index of its value, value) for `--flag V` or `--flag=V`."""
    for i, arg in enumerate(argv):
        if arg == flag:
            if i + 1 >= len(argv):
                raise LaunchError(f"{flag} needs a value")
            return i, i + 1, argv[i + 1]
        if arg.startswith(flag + "="):
            return i, i, arg.split("=", 1)[1]
    return None


def _read_extra(value: str) -> dict:
    if value.startswith("@"):
        path = Path(value[1:])
        text = path.read_text()
        try:
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
            raise LaunchError(f"{EXTRA_FLAG} {value}: {exc}") from None
    else:
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            raise LaunchError(f"{EXTRA_FLAG} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise LaunchError(f"{EXTRA_FLAG} must be a JSON object")
    return data


def _check_hint_sources(adapter: AdapterConfig, host_flag: tuple[int, int, str] | None) -> None:
    """The engine's HTTP server takes `kv_hints` naming a source: open to other hosts, its runner
    must not pull from any source without keys (kvcr.config.check_hint_sources)."""
    try:
        runner = load_config(adapter.runner_config or None, {"runner.peers": ["*"], **(adapter.runner or {})})
        check_hint_sources(runner, host_flag[2] if host_flag else "127.0.0.1")  # SGLang's default host
    except ConfigError as exc:
        raise LaunchError(f"the engine's runner: {exc}") from None


def _engine_events(argv: list[str], adapter: AdapterConfig, events_dir: str | None) -> dict | None:
    """SGLang's --kv-events-config for the runner to relay, on sockets in `events_dir` (private to
    this user), or None: the operator configured events, turned them off, or runs DP (ipc
    endpoints serve one rank)."""
    if events_dir is None or not adapter.engine_events or adapter.sidecar or _flag_value(argv, EVENTS_FLAG):
        return None
    if any((dp := _flag_value(argv, flag)) and dp[2] != "1" for flag in DP_FLAGS):
        return None
    try:
        runner = load_config(adapter.runner_config or None, adapter.runner or {})
    except ConfigError as exc:
        raise LaunchError(f"the engine's runner: {exc}") from None
    if runner.events.engine_endpoint:  # the runner relays what its config names
        return None
    return {"publisher": "zmq", "endpoint": f"ipc://{events_dir}/events", "bind": True,
            "replay_endpoint": f"ipc://{events_dir}/replay", "topic": "", "format": runner.events.event_format}


def rewrite_args(argv: list[str], events_dir: str | None = None) -> list[str]:
    """SGLang arguments with `--hicache-storage-backend kvcr` turned into `dynamic` + extra-config;
    with `events_dir`, the engine also publishes its KV events there for its runner to relay."""
    found = _flag_value(argv, BACKEND_FLAG)
    if found is None or found[2] != "kvcr":
        return list(argv)
    out = list(argv)
    flag_at, value_at, _ = found
    out[flag_at:value_at + 1] = [BACKEND_FLAG, "dynamic"]
    extra_found = _flag_value(out, EXTRA_FLAG)
    extra = _read_extra(extra_found[2]) if extra_found else {}
    try:  # refuse a bad kvcr key now, by name, rather than deep inside a scheduler process
        adapter = parse_adapter_config(extra)
    except AdapterConfigError as exc:
        raise LaunchError(str(exc)) from None
    if not adapter.sidecar:  # a sidecar's own config says whom it pulls from
        _check_hint_sources(adapter, _flag_value(argv, "--host"))
    events = _engine_events(argv, adapter, events_dir)
    if events is not None:
        relay = {"events.engine_endpoint": events["endpoint"], "events.engine_replay_endpoint": events["replay_endpoint"]}
        # Last: a nested `events` table of the operator's must not replace them (it names no engine endpoint).
        extra = {**extra, "runner": {**(extra.get("runner") or {}), **relay}}
        out += [EVENTS_FLAG, json.dumps(events)]
    # TP > 1 and MLA engines attach every rank to the worker's sidecar runner.
    backend = {**DYNAMIC, "class_name": "KVCRSidecarStorage", "module_path": "sglang_adapter.sidecar"} \
        if extra.get("sidecar") else DYNAMIC
    merged = json.dumps({**DEFAULTS, **extra, **backend})
    if extra_found:
        out[extra_found[0]:extra_found[1] + 1] = [EXTRA_FLAG, merged]
    else:
        out += [EXTRA_FLAG, merged]
    if "--enable-hierarchical-cache" not in out and "--enable-hicache" not in out:
        out.append("--enable-hierarchical-cache")
    return out


def _default(f: dataclasses.Field) -> object:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return list(value) if isinstance(value, tuple) else value


def adapter_keys_help(width: int = 79) -> str:
    """The epilog of --help: kvcr's extra-config keys, from AdapterConfig's fields."""
    lines = [f"kvcr extra-config keys ({EXTRA_FLAG} with {BACKEND_FLAG} kvcr:",
             "a JSON object, @file.json or @file.toml):"]
    for f in dataclasses.fields(AdapterConfig):
        lines.append(f"  {f.name} ({_JSON_TYPES[KEY_TYPES[f.name]]}, default {json.dumps(_default(f))})")
        lines += textwrap.wrap(f.metadata["help"], width,
                               initial_indent=" " * 6, subsequent_indent=" " * 6)
    controller = ", ".join(f"{k} (launcher default {json.dumps(DEFAULTS[k])})" if k in DEFAULTS else k
                           for k in sorted(CONTROLLER_KEYS))
    lines += ["", *textwrap.wrap(f"Also accepted, read by SGLang's HiCache controller: {controller}. The "
                                 "launcher fills in backend_name, module_path, class_name and interface_v1.",
                                 width)]
    return "\n".join(lines)


def build_help_parser(prog: str) -> argparse.ArgumentParser:
    """SGLang's server parser, built as prepare_server_args builds it, with `kvcr` added to the
    storage-backend choices. Only for --help: real arguments go through rewrite_args first."""
    from sglang.srt.server_args import ServerArgs

    # RawDescription: the epilog keeps its per-key lines (argparse would reflow them into one).
    parser = argparse.ArgumentParser(prog=prog, epilog=adapter_keys_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    action = parser._option_string_actions[BACKEND_FLAG]
    action.choices = [*action.choices, "kvcr"]
    action.help = f"{action.help} {KVCR_CHOICE_HELP}"
    return parser


def reclaim_regions() -> list[str]:
    """After the engine's processes are gone: their runners' regions (SGLang SIGKILLs the
    schedulers, so KVCRStorage.close never unlinks them). sweep_stale logs what it removed."""
    try:
        return sweep_stale()
    except OSError as exc:  # never hide why run_server ended behind a cleanup failure
        print(f"kvcr sglang: could not sweep shared-memory regions: {exc}", file=sys.stderr)
        return []


def print_help(prog: str) -> int:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as before a real start: a plugin may add arguments
    build_help_parser(prog).print_help()
    return 0


def main(argv: list[str] | None = None, *, prog: str = PROG) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    events_dir = ""
    try:
        check_version()
        if HELP_FLAGS.intersection(args):  # starts nothing, so it needs no valid kvcr extra-config
            return print_help(prog)
        events_dir = tempfile.mkdtemp(prefix="kvcr-engine-")  # 0700: only this user reaches the sockets
        args = rewrite_args(args, events_dir)
    except (UnsupportedSGLang, LaunchError, OSError) as exc:
        print(f"kvcr sglang: {exc}", file=sys.stderr)
        if events_dir:
            shutil.rmtree(events_dir, ignore_errors=True)
        return 2
    os.environ["KVCR_SGLANG_HOOKS"] = "1"  # scheduler processes install the hooks when they load the backend
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    try:
        load_plugins()
        run_server(prepare_server_args(args))
    finally:
        try:
            kill_process_tree(os.getpid(), include_parent=False)  # waits until every child is reaped
        finally:
            reclaim_regions()
            shutil.rmtree(events_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
