"""Build a worker from its options: runner config, model, engine, HTTP front."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import torch

from ..config import ConfigError, check_hint_sources, load_config
from ..service import Service
from .engine import POOL, Engine
from .model import TinyLM
from .options import ModelConfig
from .server import Worker, serve

# The bundled tokenizer's specials (it has no tokenizer_config.json of its own).
DEFAULT_SPECIAL = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}


def build(args: argparse.Namespace, overrides: dict) -> Worker:
    from ..text import TextTokenizer

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
    if cfg.runner.dp_size > 1:
        raise ConfigError(f"runner.dp_size = {cfg.runner.dp_size}: a kvcr worker is one engine of one rank (set "
                          "runner.dp_rank alone to number it)")
    check_hint_sources(cfg, args.host)
    service = Service(cfg).start()
    try:
        engine = Engine(TinyLM(model_cfg), service.runner, service.pulls, args.page_size)
        return Worker(service, engine, tokenizer, model_name)
    except BaseException:
        service.stop()
        raise


def dynamo_companion(args: argparse.Namespace, worker: Worker):
    """Starts the Dynamo bridge for this worker once its HTTP front is up (`--dynamo`)."""
    from ..dynamo.launch import BridgeOptions, bridge_file, dynamo_python, keys_env, start_bridge
    from ..dynamo.model_dir import write_model_dir

    python = dynamo_python(args.dynamo_python)  # fail before serving, not after
    tok = worker.tokenizer
    model_dir = write_model_dir(None, tokenizer_json=tok.path, vocab_size=tok.vocab_size,
                                max_positions=worker.engine.model.cfg.max_positions, bos_id=tok.bos_id,
                                eos_id=tok.eos_id, special=tok.special_tokens or DEFAULT_SPECIAL)

    ready = str(bridge_file(args.info_file)) if args.info_file else None
    if ready:
        Path(ready).unlink(missing_ok=True)  # a previous run's: it names a Dynamo worker that is gone

    def start(url: str):
        options = BridgeOptions(backend=url, model_path=str(model_dir), python=python,
                                model_name=args.dynamo_model_name or worker.model_name,
                                namespace=args.dynamo_namespace, oracle=args.dynamo_oracle,
                                ready_file=ready)
        return start_bridge(options, env=keys_env(worker.service.cfg.curve()))
    return start


def run(args: argparse.Namespace, overrides: dict) -> int:
    worker = build(args, overrides)
    try:
        companion = dynamo_companion(args, worker) if args.dynamo else None
    except BaseException:
        worker.service.stop()
        raise
    return asyncio.run(serve(worker, args.host, args.port, args.info_file, companion))
