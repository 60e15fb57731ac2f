"""Build a worker from its options: runner config, model, engine, HTTP front."""

from __future__ import annotations

import argparse
import asyncio

import torch

from ..config import load_config
from ..service import Service
from .engine import POOL, Engine
from .model import TinyLM
from .options import ModelConfig
from .server import Worker, serve


def build(args: argparse.Namespace, overrides: dict) -> Worker:
    from router_hints.text import TextTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = TextTokenizer(args.tokenizer)
    model_cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden=args.hidden, layers=args.layers,
                            heads=args.heads, seed=args.seed)
    # The pool's page is one page of this model's K/V; the namespace names the model, so only
    # workers running the same weights share pages.
    model_name = f"kvcr-tiny-l{args.layers}-h{args.hidden}-s{args.seed}"
    forced = {"runner.block_size": args.page_size, "namespace.model": model_name, "namespace.dtype": "float32",
              "dram.pools": [{"name": POOL, "page_bytes": model_cfg.page_bytes(args.page_size)}]}
    cfg = load_config(args.config, {"runner.name": args.name, "runner.peers": ["*"], **overrides, **forced})
    service = Service(cfg).start()
    try:
        engine = Engine(TinyLM(model_cfg), service.runner, args.page_size)
        return Worker(service, engine, tokenizer, model_name)
    except BaseException:
        service.stop()
        raise


def run(args: argparse.Namespace, overrides: dict) -> int:
    worker = build(args, overrides)
    asyncio.run(serve(worker, args.host, args.port, args.info_file))
    return 0
