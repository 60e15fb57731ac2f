"""`kvcr router` and `kvcr replay`: router_hints' commands, added to kvcr's CLI through the
`kvcr.commands` entry points (pyproject.toml), so kvcr never imports this package."""

from __future__ import annotations

import argparse
import sys

from kvcr.cli import parse_set


def add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="the reference KV-aware HTTP router (router_hints)")
    p.add_argument("--config", required=True, help="router config (TOML or JSON)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a router config key")
    p.add_argument("--info-file", help="write the router's info JSON (url) here once up")
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    from .discovery import DiscoveryError
    from .http.config import RouterConfigError
    from .http.server import run

    try:
        return run(args.config, parse_set(args.set), info_file=args.info_file)
    except (RouterConfigError, DiscoveryError, FileNotFoundError) as exc:
        print(f"kvcr router: {exc}", file=sys.stderr)
        return 2


def add_replay(sub: argparse._SubParsersAction) -> None:
    from .replay.main import add_arguments

    p = sub.add_parser("replay", help="a request trace through simulated workers: kvcr against the alternatives")
    add_arguments(p)
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay.main import run

    return run(args)
