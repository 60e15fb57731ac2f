"""Live: what routers see of a default `kvcr sglang` engine, and that they hint only what its runner holds.

The launcher wires the engine's own KV events into its runner by default, so one stream per worker
carries the engine's device blocks (GPU), its host pool (CPU_PINNED) and the runner's DRAM
(CPU_TIER1). Here each runner's DRAM holds fewer pages than the engine's host pool, so the two
inventories differ: older prompts stay on the engine while its runner has let them go.
"""

from __future__ import annotations

import json

import pytest

from kvcr.demo.httpc import http
from kvcr.demo.sglang_driver import metric as summed
from kvcr.drivers.zmq_subscriber import Delivery, Subscriber
from kvcr.proto.events import BlockStored
from kvcr.proto.keys import U64_MASK
from kvcr.text import TextTokenizer
from sglang_adapter.cpu_harness.model import prompt_text
from tests.helpers import wait_until
from tests.sglang_live.helpers import kvcr_router, metric

pytestmark = pytest.mark.live_sglang
PAGE = 16
# 16 runner pages of the tiny model (8 KiB each) against the engine's 512-page host pool.
SMALL_DRAM = {"dram.size": "128Ki"}
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(engines, tiny_model, tmp_path_factory):
    a, b = engines("truth-A", "truth-B", runner=SMALL_DRAM,
                   args=["--hicache-storage-prefetch-policy", "wait_complete", "--enable-cache-report"])
    front = kvcr_router(tmp_path_factory.mktemp("router"), tiny_model, [
        {"name": s.name, "url": s.url, "runner": s.endpoints["control"], "engine": "sglang"} for s in (a, b)])
    try:
        yield front, a, b, TextTokenizer(tiny_model)
    finally:
        front.stop()


def generate(front, text: str, target: str) -> dict:
    status, headers, raw = http(front.url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 2, **GREEDY}},
                                {"X-KVCR-Target": target})
    assert status == 200 and headers.get("X-KVCR-Worker") == target, raw[-2000:]
    return json.loads(raw)


def overlap(front, text: str, worker: str) -> dict:
    """The worker's overlap by tier in the router's index, with "runner": the leading blocks its
    runner holds (what a hint may name)."""
    status, _, raw = http(f"{front.url}/debug/index", {"text": text})
    assert status == 200, raw
    row = next((r for r in json.loads(raw)["workers"] if r["worker"] == worker), None)
    return {**row["overlap"], "runner": row["runner"]} if row else {"device": 0, "host": 0, "dram": 0, "disk": 0,
                                                                     "runner": 0}


def hints_issued(front) -> float:
    return summed(http(front.url + "/metrics")[2].decode(), "kvcr_router_hints_total", outcome="issued")


def test_a_default_engines_device_host_and_runner_tiers_reach_the_router_apart(cluster):
    front, a, _, tok = cluster
    sub = Subscriber()
    sub.add("a", a.endpoints["events"], a.endpoints["replay"])
    try:
        text = prompt_text(611, 300)
        generate(front, text, a.name)
        full = len(tok.encode(text)) // PAGE
        # The router sees the prompt on A's device (the engine's events, relayed by A's runner) and,
        # once backed up, in A's runner: two inventories, told apart.
        seen = wait_until(lambda: (o := overlap(front, text, a.name))["device"] == full and o["runner"] == full and o,
                          timeout_s=30, message="A's device blocks and runner pages in the router's index")
        assert seen["device"] + seen["host"] + seen["dram"] + seen["disk"] == full
        media: dict[str | None, set[int]] = {}

        def stream_has_all_tiers():
            for item in sub.poll(200):
                if isinstance(item, Delivery):
                    for e in item.batch.events:
                        if isinstance(e, BlockStored):
                            media.setdefault(e.medium, set()).update(h & U64_MASK for h in e.block_hashes)
            return {"GPU", "CPU_PINNED", "CPU_TIER1"} <= set(media)
        wait_until(stream_has_all_tiers, timeout_s=30, message="GPU, CPU_PINNED and CPU_TIER1 stores in A's stream")
    finally:
        sub.close()


def test_hints_name_only_pages_the_sources_runner_holds_though_its_engine_holds_more(cluster):
    front, a, b, tok = cluster
    texts = [prompt_text(620 + i, 380) for i in range(5)]  # ~23 pages each: A's runner keeps about one prompt
    for text in texts:
        generate(front, text, a.name)
    last_full = len(tok.encode(texts[-1])) // PAGE
    wait_until(lambda: overlap(front, texts[-1], a.name)["runner"] == last_full, timeout_s=30,
               message="A's runner holds the last prompt")
    assert metric(a.runner_get("/metrics"), "kvcr_pages_dropped_total") > 0  # it let the first prompts go
    first = overlap(front, texts[0], a.name)
    assert first["device"] + first["host"] > first["runner"]  # the engine still holds what the runner dropped

    pulled_before = metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total")
    hints_before = hints_issued(front)
    for text in texts:  # pinned to B: the router still attaches and posts a hint naming A's runner
        generate(front, text, b.name)
    wait_until(lambda: metric(a.runner_get("/metrics"), "kvcr_claims_held") == 0, timeout_s=15,
               message="A's claims released")
    assert hints_issued(front) > hints_before
    pulled = metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total") - pulled_before
    assert 0 < pulled < sum(len(tok.encode(t)) // PAGE for t in texts)  # what A's runner still held, no more
    # No claim found a page missing: not one A's runner never held, nor one it let go (A is idle,
    # so its runner evicts nothing between the router's decision and B's claim).
    for cause in ("never_held", "evicted"):
        assert metric(a.runner_get("/metrics"), "kvcr_hint_unheld_pages_total", cause=cause) == 0, cause
