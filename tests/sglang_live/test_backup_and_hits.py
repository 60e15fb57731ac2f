"""Live test 1: an engine with `--hicache-storage-backend kvcr` backs its pages up into kvcr,
announces them with the engine's own hashes, and serves them back after /flush_cache."""

from __future__ import annotations

import json

import pytest
import zmq

from kvcr.proto.events import BlockStored, decode_frames
from tests.helpers import wait_until
from tests.sglang_live.helpers import metric
from sglang_adapter.cpu_harness.model import prompt_text
from sglang_adapter.cpu_harness.server import free_port

pytestmark = pytest.mark.live_sglang
PAGE = 16


def stored_hashes(events) -> set[int]:
    return {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}


class EngineEvents:
    """SGLang's own KV event stream (its ZMQ publisher), read as Dynamo would."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.events: list = []

    def drain(self) -> set[int]:
        while self.sock.poll(200):
            self.events.extend(decode_frames(self.sock.recv_multipart())[2].events)
        return stored_hashes(self.events)


# A DRAM tier of 64 pages that evicts written pages above half full: most of a 37-page prompt is then on NVMe only.
NVME = {"dram.size": "256Ki", "dram.high_watermark": 0.5, "dram.low_watermark": 0.2}


@pytest.fixture(scope="module", params=["layer_first", "page_first", "page_first+nvme"])
def engine(request, engines, tmp_path_factory):
    layout, _, tier = request.param.partition("+")
    runner = {**NVME, "nvme.storage_dir": str(tmp_path_factory.mktemp("nvme"))} if tier else {}
    port = free_port()
    kv_events = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True, "topic": ""}
    (server,) = engines(f"backup-{layout}{'-' + tier if tier else ''}", runner=runner, args=[
        "--hicache-mem-layout", layout, "--hicache-storage-prefetch-policy", "wait_complete",
        "--kv-events-config", json.dumps(kv_events)])
    server.nvme = bool(tier)
    server.engine_events = EngineEvents(kv_events["endpoint"])
    return server


def test_backed_up_pages_are_announced_with_the_engines_hashes_and_hit_after_a_flush(engine, live):
    text = prompt_text(11, 600)
    first = live.generate(engine, text)
    prompt = first["meta_info"]["prompt_tokens"]
    full = prompt // PAGE
    announced = wait_until(lambda: set(engine.stored_hashes()) if len(set(engine.stored_hashes())) >= full else None,
                           timeout_s=30, message="the prompt's pages backed up into kvcr")
    engine_hashes = wait_until(lambda: engine.engine_events.drain() or None, timeout_s=10,
                               message="SGLang's own stored events")
    assert len(announced) == full
    assert announced <= engine_hashes, "kvcr announced hashes the engine itself never published"
    if engine.nvme:  # written behind, then evicted from DRAM: served from NVMe (promoted on read) after the flush
        def on_nvme():
            text = engine.runner_get("/metrics")
            return metric(text, "kvcr_spilled_pages_total") >= full and metric(text, "kvcr_write_behind_queue") == 0
        wait_until(on_nvme, timeout_s=30, message="the prompt's pages written to NVMe")
    live.flush(engine)
    again = live.generate(engine, text)
    meta = again["meta_info"]
    assert meta["cached_tokens"] == full * PAGE
    assert meta["cached_tokens_details"]["storage"] == full * PAGE
    assert meta["cached_tokens_details"]["storage_backend"] == "KVCRStorage"
    assert again["output_ids"] == first["output_ids"]
    assert live.logprobs(again) == live.logprobs(first)
    assert metric(engine.runner_get("/metrics"), "kvcr_hits_total") >= full
    if engine.nvme:
        assert metric(engine.runner_get("/metrics"), "kvcr_promoted_pages_total") > 0


def salted(server, salt: str) -> set[int]:
    return {h for e in server.stored() if e.cache_salt == salt for h in e.block_hashes}


def test_salted_pages_are_announced_under_their_salt_and_never_hit_for_another(engine, live):
    text = prompt_text(12, 300)
    first = live.generate(engine, text, cache_salt="tenant-a")
    full = first["meta_info"]["prompt_tokens"] // PAGE
    wait_until(lambda: len(salted(engine, "tenant-a")) >= full, timeout_s=30,
               message="the salted pages announced with their salt")
    live.flush(engine)
    other = live.generate(engine, text, cache_salt="tenant-b")
    assert other["meta_info"]["cached_tokens"] == 0
    unsalted = live.generate(engine, text)
    assert unsalted["meta_info"]["cached_tokens"] == 0
    same = live.generate(engine, text, cache_salt="tenant-a")
    assert same["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
