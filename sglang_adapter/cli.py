"""`kvcr sglang`: SGLang with `--hicache-storage-backend kvcr` and kvcr's hooks, added to kvcr's CLI
through the `kvcr.commands` entry points (pyproject.toml)."""

from __future__ import annotations

import argparse


def add_sglang(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sglang", help="launch SGLang with --hicache-storage-backend kvcr (and kvcr's hooks)",
                       prefix_chars="\0")  # every argument is SGLang's
    p.add_argument("sglang_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_sglang)


def cmd_sglang(args: argparse.Namespace) -> int:
    from .launch_server import main as launch

    return launch(args.sglang_args, prog="kvcr sglang")
