"""The worker's model shape and command-line options (no torch here: `kvcr --help` stays fast)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    vocab_size: int = 2048
    hidden: int = 256
    layers: int = 6
    heads: int = 8
    max_positions: int = 8192
    seed: int = 0

    def page_bytes(self, page_size: int) -> int:
        """K and V of every layer for one page, float32."""
        return self.layers * 2 * page_size * self.hidden * 4

_DEFAULT = ModelConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="worker0", help="worker (and runner) name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="HTTP port (0: any free port)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (the runner's block_size)")
    p.add_argument("--layers", type=int, default=_DEFAULT.layers)
    p.add_argument("--hidden", type=int, default=_DEFAULT.hidden)
    p.add_argument("--heads", type=int, default=_DEFAULT.heads)
    p.add_argument("--seed", type=int, default=0, help="weights come from this seed; workers sharing KV share it")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or a directory with one (default: bundled)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--config", help="runner config (TOML or JSON), as for `kvcr serve`")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a runner config key")
    p.add_argument("--info-file", help="write the worker's info JSON (url, runner endpoints) here once up")
    d = p.add_argument_group("Dynamo", "serve behind Dynamo's frontend and KV router (docs/dynamo.md)")
    d.add_argument("--dynamo", action="store_true",
                   help="register with Dynamo's runtime (discovery and planes from its DYN_* variables)")
    d.add_argument("--dynamo-namespace", default="kvcr", help="Dynamo namespace (the component is `backend`)")
    d.add_argument("--dynamo-model-name", help="model name Dynamo serves (default: the worker's)")
    d.add_argument("--dynamo-python", help="Python of Dynamo's environment (default: $KVCR_DYNAMO_PYTHON, "
                   "then .venv-dynamo)")
    d.add_argument("--dynamo-oracle", action="store_true", help="check every Dynamo-routed answer (tests)")
