"""`python -m sglang_adapter.launch_server ...` (or `kvcr sglang ...`): SGLang's own launcher that
also accepts `--hicache-storage-backend kvcr`, and installs kvcr's hooks in every scheduler.

`kvcr` becomes SGLang's `dynamic` backend with kvcr's module, class and zero-copy interface
merged into the extra-config, and prefetch timeouts that leave room for a peer pull.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path

from .config import AdapterConfigError, parse_adapter_config
from .hooks import UnsupportedSGLang, check_version

BACKEND_FLAG = "--hicache-storage-backend"
EXTRA_FLAG = "--hicache-storage-backend-extra-config"
DYNAMIC = {"backend_name": "kvcr", "module_path": "sglang_adapter.storage", "class_name": "KVCRStorage",
           "interface_v1": 1}
# bench/sglang_adapter.py (docs/sglang.md): warm 8k/32k-token pulls took 66/156 ms (p99) on one host,
# a first contact with a new peer up to ~0.66 s; a 10 GbE link needs ~0.03 s per 1k tokens of a
# 28-layer model. A 2 s base is about 3x the first contact; SGLang's 0.25 s per 1k tokens stays
# (>= 2x either link). SGLang's 1 s base leaves too little room for a first pull.
TIMEOUTS = {"prefetch_timeout_base": 2.0, "prefetch_timeout_per_ki_token": 0.25}
# prefix keys let a backed-up page name its parent, so its announce continues the chain routers match.
DEFAULTS = {**TIMEOUTS, "hicache_storage_pass_prefix_keys": True}


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


def rewrite_args(argv: list[str]) -> list[str]:
    """SGLang arguments with `--hicache-storage-backend kvcr` turned into `dynamic` + extra-config."""
    found = _flag_value(argv, BACKEND_FLAG)
    if found is None or found[2] != "kvcr":
        return list(argv)
    out = list(argv)
    flag_at, value_at, _ = found
    out[flag_at:value_at + 1] = [BACKEND_FLAG, "dynamic"]
    extra_found = _flag_value(out, EXTRA_FLAG)
    extra = _read_extra(extra_found[2]) if extra_found else {}
    try:  # refuse a bad kvcr key now, by name, rather than deep inside a scheduler process
        parse_adapter_config(extra)
    except AdapterConfigError as exc:
        raise LaunchError(str(exc)) from None
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


def main(argv: list[str] | None = None) -> int:
    try:
        check_version()
        args = rewrite_args(list(sys.argv[1:] if argv is None else argv))
    except (UnsupportedSGLang, LaunchError, OSError) as exc:
        print(f"kvcr sglang: {exc}", file=sys.stderr)
        return 2
    os.environ["KVCR_SGLANG_HOOKS"] = "1"  # scheduler processes install the hooks when they load the backend
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(args)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
