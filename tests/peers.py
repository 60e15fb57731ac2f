"""Two runner processes and what the peer tests do with them: store seeded pages at one, pull them
into the other, read them back, count the claims left."""

import ctypes
import urllib.request

from kvcr.client import AttachedWriter, ControlClient
from kvcr.proto import messages as m
from tests.helpers import wait_until
from tests.pages import pages_for


PAGE = 64 * 1024


POOLS = [{"name": "kv", "page_bytes": PAGE}]


def start_pair(runner_factory, b_overrides=None, a_overrides=None):
    a = runner_factory("a", **{"dram.pools": POOLS, **(a_overrides or {})})
    b = runner_factory("b", **{"dram.pools": POOLS, "runner.peers": ["*"], **(b_overrides or {})})
    return a, a.start(), b, b.start()


def store(info, n, seed=0, upto=None):
    keys, ann, data = pages_for(n, seed=seed, page_bytes=PAGE)
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        writer.put("kv", keys[:upto], data[:upto], ann[:upto])
        writer.close()
    return keys, ann, data


def read(info, keys):
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        try:
            return writer.get("kv", keys)
        finally:
            writer.close()


def claims_held(info) -> float:
    text = urllib.request.urlopen(info["endpoints"]["http"] + "/metrics", timeout=5).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvcr_claims_held "))


def no_claims_left(info):
    # A release that finished inside the lease is sent without waiting: it lands a moment later.
    wait_until(lambda: claims_held(info) == 0, 5, 0.02, "the source holds no claims")


def pull(info, source_info, keys, timeout_s=30.0):
    with ControlClient(info["endpoints"]["control"], timeout_s=timeout_s) as client:
        return client.request(m.PullRequest(source_endpoint=source_info["endpoints"]["control"], pool="kv",
                                     keys=keys)).num_local


def wait_registered(info):
    with ControlClient(info["endpoints"]["control"]) as client:
        wait_until(lambda: client.info()["ucx"]["rkeys"], 10, 0.05, "UCX registration")


def buffers(n, fill=0xAB):
    raw = ctypes.create_string_buffer(bytes([fill]) * (n * PAGE))
    return raw, [ctypes.addressof(raw) + i * PAGE for i in range(n)]


def source(runner_factory, **overrides):
    a = runner_factory("a", **{"dram.pools": POOLS, **overrides})
    ai = a.start()
    wait_registered(ai)
    return a, ai
