"""A burst of three times DRAM into a real `kvcr serve` with an NVMe tier, then a restart on the
same directory: what DRAM lets go is kept by NVMe or counted, and what NVMe keeps is reachable."""

import random
import signal
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcr.client import AttachedWriter, ControlClient
from kvcr.proto.announce import announce_request
from kvcr.proto.events import BlockStored
from kvcr.proto.keys import request_page_hashes
from tests.helpers import wait_until

BLOCK = 16
PAGE = 65536
PAGES_PER_REQUEST = 16
NUM_REQUESTS = 6  # 96 pages of 64 KiB into 32 DRAM slots


@pytest.fixture
def burst():
    """Six requests of 16 pages: (page hashes, announces, bytes, tokens) each."""
    out = []
    for seed in range(NUM_REQUESTS):
        rng = random.Random(1000 + seed)
        tokens = [rng.randrange(50000) for _ in range(PAGES_PER_REQUEST * BLOCK)]
        out.append((request_page_hashes(tokens, BLOCK), announce_request(tokens, BLOCK),
                    [rng.randbytes(PAGE) for _ in range(PAGES_PER_REQUEST)], tokens))
    return out


def runner_config(tmp_path, **overrides):
    return {"dram.size": "2Mi", "dram.pools": [{"name": "kv", "page_bytes": "64Ki"}],
            "nvme.storage_dir": str(tmp_path / "nvme"), **overrides}


def scrape(info, name: str, **labels) -> float:
    """Sum of the samples of `name` (a counter's _total included) carrying `labels`."""
    text = urllib.request.urlopen(info["endpoints"]["http"] + "/metrics", timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name in (name, name + "_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def store(info, burst) -> None:
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        for hexes, ann, data, _ in burst:
            assert writer.put("kv", hexes, data, ann) == PAGES_PER_REQUEST
        writer.close()


def held(info) -> dict[str, set[int]]:
    """Event hashes the runner's snapshot announces, by medium."""
    with ControlClient(info["endpoints"]["control"]) as client:
        _, events = client.snapshot()
    media: dict[str, set[int]] = {}
    for e in events:
        if isinstance(e, BlockStored):
            media.setdefault(e.medium, set()).update(e.block_hashes)
    return media


def leading(hashes: set[int], ann) -> int:
    return next((i for i, a in enumerate(ann) if a.event_hash not in hashes), len(ann))


@pytest.mark.parametrize("policy", ["write_behind", "spill"])
def test_a_burst_of_three_times_dram_loses_no_page_while_nvme_has_room(runner_factory, tmp_path, burst, policy):
    info = runner_factory(**runner_config(tmp_path, **{"nvme.max_size": "8Mi", "nvme.write_policy": policy})).start()
    store(info, burst)
    assert scrape(info, "kvcr_pages_dropped") == 0
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        for hexes, _, data, _ in burst:  # every page comes back byte for byte, from DRAM or NVMe
            assert writer.get("kv", hexes) == data
        writer.close()
    assert scrape(info, "kvcr_pages_dropped") == 0 and scrape(info, "kvcr_promoted_pages") > 0


@pytest.mark.dynamo
def test_a_burst_larger_than_nvme_counts_its_drops_and_a_restart_serves_reachable_prefixes(
        indexer, runner_factory, tmp_path, burst):
    from tests.dynamo import registered_runner

    proc, info, reg = registered_runner(indexer, runner_factory, **runner_config(tmp_path, **{"nvme.max_size": "3Mi"}))
    store(info, burst)
    wait_until(lambda: scrape(info, "kvcr_write_behind_queue") == 0, 20, 0.1, "write-behind queue drained")
    media = held(info)
    kept = media.get("CPU_TIER1", set()) | media.get("DISK", set())
    dropped = scrape(info, "kvcr_pages_dropped")
    assert dropped > 0 and len(kept) + dropped >= NUM_REQUESTS * PAGES_PER_REQUEST  # nothing lost silently
    assert proc.stop(signal.SIGTERM) == 0

    info = proc.start()
    files = len(list((tmp_path / "nvme").glob("ns-*/*.bin")))
    disk = wait_until(lambda: (d := held(info).get("DISK", set())) and len(d) == files and d, 20, 0.1,
                      "every page on NVMe announced after the restart")
    assert 0 < len(disk) <= 48
    for hexes, ann, data, tokens in burst:
        n = leading(disk, ann)
        assert {a.event_hash for a in ann} & disk == {a.event_hash for a in ann[:n]}  # a prefix: reachable
        wait_until(lambda: reg.query(tokens).get("disk", 0) == n * BLOCK, 20, 0.2,
                   f"Dynamo's indexer sees {n} pages of this request on disk")
    assert sum(leading(disk, ann) for _, ann, _, _ in burst) == len(disk)


def test_a_sigkill_during_write_behind_leaves_only_whole_announced_pages(runner_factory, tmp_path, burst):
    proc = runner_factory(**runner_config(tmp_path, **{"nvme.fsync": True}))
    info = proc.start()
    store(info, burst)
    proc.stop(signal.SIGKILL)  # the writer is likely mid-batch: published, not yet recorded

    info = proc.start()
    files = len(list((tmp_path / "nvme").glob("ns-*/*.bin")))
    wait_until(lambda: scrape(info, "kvcr_pages", tier="nvme", state="ready") == files, 20, 0.1, "scan done")
    disk = held(info).get("DISK", set())
    assert len(disk) <= files and not list((tmp_path / "nvme").glob("ns-*/*.bin.tmp"))
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        for hexes, ann, data, _ in burst:
            n = leading(disk, ann)
            assert {a.event_hash for a in ann} & disk == {a.event_hash for a in ann[:n]}
            assert writer.get("kv", hexes[:n]) == data[:n]  # announced pages are whole and right
        writer.close()
