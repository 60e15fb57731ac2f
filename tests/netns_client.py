"""A client program the netns tests run on a test host (it must be on the runner's host to write
into its pool, and on a host of its own to pull as a stranger's peer would).

    python -m tests.netns_client put  CONTROL N SEED     # store N seeded pages at the runner
    python -m tests.netns_client pull CONTROL N SEED     # pull them from CONTROL over UCX and check every byte

Prints one JSON line. CURVE keys come from KVCR_TEST_CURVE_PUBLIC / KVCR_TEST_CURVE_SECRET.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

from kvcr.client import AttachedWriter, ControlClient
from kvcr.config import CurveKeys
from tests.pages import pages_for

PAGE = 64 * 1024


def curve() -> CurveKeys:
    public, secret = os.environ["KVCR_TEST_CURVE_PUBLIC"].encode(), os.environ["KVCR_TEST_CURVE_SECRET"].encode()
    return CurveKeys(public, secret, frozenset())


def put(control: str, n: int, seed: int) -> dict:
    keys, ann, data = pages_for(n, seed=seed, page_bytes=PAGE)
    with ControlClient(control, curve=curve(), timeout_s=10) as client:
        writer = AttachedWriter(client)
        writer.put("kv", keys, data, ann)
        writer.close()
    return {"stored": n}


def pull(control: str, n: int, seed: int) -> dict:
    from kvcr.drivers.ucx_plane import UcxPlane
    from kvcr.drivers.puller import Puller

    keys, _, data = pages_for(n, seed=seed, page_bytes=PAGE)
    plane = UcxPlane(interface="eth0")
    puller = Puller(plane, curve=curve(), verify_transfer_bytes=True, timeout_s=5, abandon_s=2)
    buf = ctypes.create_string_buffer(b"\xab" * (PAGE * n))
    result = puller.pull(control, "kv", keys, [ctypes.addressof(buf) + i * PAGE for i in range(n)])
    wrong = sum(buf.raw[i * PAGE:(i + 1) * PAGE] != data[i] for i in range(result.delivered))
    puller.close()
    plane.close()
    return {"delivered": result.delivered, "wrong": wrong, "uncertain": result.uncertain, "error": result.error}


if __name__ == "__main__":
    command, control, count, seed_arg = sys.argv[1:5]
    print(json.dumps((put if command == "put" else pull)(control, int(count), int(seed_arg))), flush=True)
