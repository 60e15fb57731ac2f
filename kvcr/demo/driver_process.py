"""`kvcr demo-driver`: the workload driver's own process, which picks the driver for the engine
(driver.py for `kvcr worker` and Dynamo, sglang_driver.py for SGLang) and records each outcome."""

from __future__ import annotations

import json

from .driver import Driver, DynamoDriver


def add_arguments(p) -> None:
    p.add_argument("--router", required=True, help="the router's base URL")
    p.add_argument("--workers", required=True, help="worker names, comma-separated")
    p.add_argument("--out", required=True, help="JSON-lines file the outcomes are appended to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--info-file", help="written once the driver runs")
    p.add_argument("--engine", default="worker", choices=("worker", "sglang"))
    # --router dynamo: --router is Dynamo's frontend; each worker as NAME=URL=DYNAMO_ID
    p.add_argument("--dynamo-workers", help="dynamo: NAME=URL=DYNAMO_WORKER_ID,... (the frontend is --router)")
    p.add_argument("--model", help="dynamo: the model name the frontend serves")
    # --engine sglang (sglang_driver.py)
    p.add_argument("--reference", help="sglang: the reference engine's URL (cold computations, the oracle)")
    p.add_argument("--runners", help="sglang: NAME=URL,... each engine's runner HTTP endpoint (its /metrics)")
    p.add_argument("--tokenizer", help="sglang: the engines' tokenizer directory (the model's)")
    p.add_argument("--page-size", type=int, default=16, help="sglang: the engines' page size")


def run_process(args) -> int:
    """`kvcr demo-driver`: the whole workload, then a final {"done": true} line."""
    import os
    from pathlib import Path

    from .workload import build

    convs, phases = build(args.seed, args.conversations, args.turns)
    workers = args.workers.split(",")
    with open(args.out, "a", buffering=1) as out:
        def record(kind: str, value: object) -> None:
            out.write(json.dumps({kind: value}) + "\n")

        if args.info_file:
            tmp = Path(args.info_file + ".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "requests": sum(len(p.steps) for p in phases),
                                       "phases": [p.name for p in phases]}))
            os.replace(tmp, args.info_file)
        if args.engine == "sglang":
            from .sglang_driver import SGLangDriver

            SGLangDriver.from_args(args, workers, convs, record).run(phases)
        elif args.dynamo_workers:
            endpoints = {name: (url, int(wid)) for name, url, wid in
                         (item.split("=", 2) for item in args.dynamo_workers.split(","))}
            DynamoDriver(args.router, endpoints, convs, model=args.model, max_tokens=args.max_tokens,
                         concurrency=len(endpoints), record=record).run(phases)
        else:
            Driver(args.router, workers, convs, max_tokens=args.max_tokens, concurrency=len(workers),
                   record=record).run(phases)
        record("done", True)
    return 0
