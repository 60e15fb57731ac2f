"""kvcr command line: serve, info, keys, events tail, selfcheck, worker, dynamo, demo, and the
commands other packages contribute (router, replay, sglang)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from . import __version__

COMMANDS_GROUP = "kvcr.commands"


def parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config
    from .drivers.shm import RegionError
    from .ranks import for_rank
    from .service import Service

    try:
        cfg = load_config(args.config, parse_set(args.set))
        if cfg.runner.dp_size > 1:  # one command for every rank: the ports given are the group's base
            cfg = for_rank(cfg, cfg.runner.dp_rank, cfg.runner.dp_size)
        service = Service(cfg).start()
    except (ConfigError, RegionError) as exc:
        print(f"kvcr serve: {exc}", file=sys.stderr)
        return 2
    if args.info_file:
        tmp = Path(args.info_file + ".tmp")
        tmp.write_text(json.dumps(service.public_info()))
        os.replace(tmp, args.info_file)
    print(json.dumps(service.public_info()), file=sys.stderr)
    service.serve_forever()
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from .curve_keys import client_http_token

    try:
        from .client import fetch_info

        print(json.dumps(fetch_info(args.endpoint, args.timeout, token=client_http_token()), indent=2))
    except (TimeoutError, OSError, ValueError) as exc:  # ValueError: a bad key in the environment
        print(f"kvcr info: {args.endpoint}: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from .curve_keys import KeysError, add_client, init

    if args.action == "init":
        made = init(args.directory)
        print(f"kvcr keys: {args.directory}: " + (f"wrote {', '.join(made)}" if made else "every key is there already"))
        return 0
    if not args.name or not args.out:
        print("kvcr keys client: give DIRECTORY NAME OUT (the client's name and its new key directory)", file=sys.stderr)
        return 2
    try:
        admitted = add_client(args.directory, args.name, args.out)
    except KeysError as exc:
        print(f"kvcr keys client: {exc}", file=sys.stderr)
        return 1
    print(f"kvcr keys: {args.out}: {args.name}'s keypair; admitted by runners through {admitted} "
          "(remove that file to revoke)")
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    from .tail import tail

    return tail(args.endpoint, args.replay, count=args.count, timeout_s=args.timeout,
                from_snapshot=args.snapshot)


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from .selfcheck import run_selfcheck

    return run_selfcheck(args.control, pages=args.pages)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.main import run

    rc = run(args)
    if rc == 130:
        # Interrupted, handled, everything stopped; yet under load CPython sometimes still exited by
        # SIGINT (status -2, no traceback: its "unhandled KeyboardInterrupt" flag was set on the way
        # to our handler, 1 run in 4 here). Ctrl-C's promised status is 130.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return rc


def cmd_worker(args: argparse.Namespace) -> int:
    from .config import ConfigError
    from .drivers.shm import RegionError
    from .dynamo.launch import DynamoSetupError
    from .worker.launch import run

    try:
        return run(args, parse_set(args.set))
    except (ConfigError, RegionError, DynamoSetupError, OSError) as exc:  # OSError: a port already in use, a missing tokenizer
        print(f"kvcr worker: {exc}", file=sys.stderr)
        return 2


def cmd_demo_driver(args: argparse.Namespace) -> int:
    from .demo.driver_process import run_process

    return run_process(args)


def cmd_dynamo(args: argparse.Namespace) -> int:
    """Runs the Dynamo bridge (kvcr.dynamo.bridge) with Dynamo's Python, which pins its own packages."""
    from .dynamo.launch import DynamoSetupError, dynamo_python

    try:
        python = dynamo_python()
    except DynamoSetupError as exc:
        print(f"kvcr dynamo: {exc}", file=sys.stderr)
        return 2
    os.execv(python, [python, "-m", "kvcr.dynamo.bridge", *args.bridge_args])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcr", description="Router-aware distributed KV-cache reuse")
    parser.add_argument("--version", action="version", version=f"kvcr {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run a runner (DRAM pool, events, control socket, /metrics)")
    p.add_argument("--config", help="TOML or JSON config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set dram.size=1Gi (repeatable)")
    p.add_argument("--info-file", help="write the runner's info JSON here once it is up")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("info", help="print a runner's info (endpoints, namespace, pools); "
                                    "KVCR_HTTP_TOKEN (or KVCR_KEYS_DIR) holds an http:// runner's token, "
                                    "KVCR_KEYS_DIR or KVCR_CURVE_PUBLIC_KEY/SECRET_KEY the CURVE keys")
    p.add_argument("endpoint", help="control endpoint tcp://HOST:PORT or http://HOST:PORT")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("keys", help="init: create a deployment's key directory (CURVE keypair, HTTP token) if "
                       "missing; client: a keypair of a client's own, admitted by the deployment's runners")
    p.add_argument("action", choices=["init", "client"])
    p.add_argument("directory", help="e.g. /etc/kvcr/keys; give it to runners as runner.keys_dir, to the "
                                     "router and the CLI as KVCR_KEYS_DIR")
    p.add_argument("name", nargs="?", help="client: its name (DIRECTORY/clients/NAME.public admits it)")
    p.add_argument("out", nargs="?", help="client: its new key directory (give it to the client as KVCR_KEYS_DIR)")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("events", help="event stream tools")
    ev = p.add_subparsers(dest="events_command", required=True)
    t = ev.add_parser("tail", help="print events as JSON lines, repairing gaps by replay")
    t.add_argument("--endpoint", required=True, help="event PUB endpoint tcp://HOST:PORT")
    t.add_argument("--replay", help="replay ROUTER endpoint tcp://HOST:PORT")
    t.add_argument("--snapshot", metavar="CONTROL", help="start from a snapshot taken from this control endpoint")
    t.add_argument("--count", type=int, default=0, help="exit after this many BlockStored blocks (0: never)")
    t.add_argument("--timeout", type=float, default=0.0, help="exit after this many seconds (0: never)")
    t.set_defaults(func=cmd_tail)

    p = sub.add_parser("selfcheck", help="store and read back pages through a running runner")
    p.add_argument("--control", required=True)
    p.add_argument("--pages", type=int, default=64)
    p.set_defaults(func=cmd_selfcheck)

    p = sub.add_parser("worker", help="a small CPU transformer behind SGLang/OpenAI routes, KV in its own runner")
    from .worker.options import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("dynamo", help="serve an engine with kvcr (SGLang, a kvcr worker) as a Dynamo worker: "
                       "`kvcr dynamo --help` lists the bridge's options", prefix_chars="\0", add_help=False)
    p.add_argument("bridge_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_dynamo)

    p = sub.add_parser("demo", help="router + N workers + workload on this machine, checked by an oracle")
    from .demo.main import add_arguments as demo_arguments

    demo_arguments(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("demo-driver", help="the demo's workload driver (kvcr demo starts it)")
    from .demo.driver_process import add_arguments as driver_arguments

    driver_arguments(p)
    p.set_defaults(func=cmd_demo_driver)
    _add_contributed(sub)
    return parser


def _add_contributed(sub: argparse._SubParsersAction) -> None:
    """Commands the packages above kvcr contribute (`kvcr router` and `kvcr replay` from router_hints,
    `kvcr sglang` from sglang_adapter), through the `kvcr.commands` entry points: kvcr itself
    imports none of them."""
    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            entry.load()(sub)
        except Exception as exc:  # one broken package must not take `kvcr serve` down with it
            print(f"kvcr: command {entry.name!r} ({entry.value}) is unavailable: {type(exc).__name__}: {exc}",
                  file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
