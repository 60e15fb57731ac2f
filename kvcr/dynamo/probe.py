"""What Dynamo's own KV router index holds, per worker and tier (run with Dynamo's Python:
`python kvcr/dynamo/probe.py NAMESPACE.backend.generate BLOCK_SIZE`).

A `KvRouter` from Dynamo's bindings follows the workers' event plane exactly as the frontend's
router does (and recovers from their local indexers when it starts). Each stdin line is a JSON
`{"tokens": [...], "cache_namespace": ...}` (the namespace may be null); each stdout line is
Dynamo's per-worker overlap for it, by tier.
"""

import asyncio
import json
import os
import sys

from dynamo.llm import KvRouter, KvRouterConfig
from dynamo.runtime import DistributedRuntime


async def main(path: str, block_size: int) -> None:
    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, os.environ.get("DYN_DISCOVERY_BACKEND", "file"),
                            os.environ.get("DYN_REQUEST_PLANE", "tcp"),
                            event_plane=os.environ.get("DYN_EVENT_PLANE", "zmq"))
    router = KvRouter(rt.endpoint(path), block_size, KvRouterConfig())
    print(json.dumps({"ready": True}), flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        query = json.loads(line)
        scores = await router.get_overlap_scores(query["tokens"], cache_namespace=query["cache_namespace"])
        print(json.dumps(scores, default=str), flush=True)
    rt.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
