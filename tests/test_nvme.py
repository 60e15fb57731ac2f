"""NVMe tier: file format, HiCacheFile interop, persistence, corruption, races, eviction, spill/promote."""

import json
import multiprocessing
import os
import threading

import pytest

from kvcr.config import load_config
from kvcr.drivers.nvme import FORMAT_VERSION, DiskError, hicache_suffix
from kvcr.proto.events import BlockRemoved, BlockStored
from kvcr.proto.keys import Namespace
from kvcr.runner import open_store
from tests.helpers import wait_until
from tests.nvme_tier import BLOCK, NS, PAGE, Tier, chain

def test_pages_round_trip_with_hicache_file_names_and_a_versioned_format(tmp_path):
    t = Tier(tmp_path)
    hexes, ann, data = chain(3)
    assert t.tier.write(hexes, [memoryview(d) for d in data], ann) == [True] * 3
    assert t.read(hexes) == data
    ns_dir = tmp_path / f"ns-{NS.digest}"
    assert sorted(p.name for p in ns_dir.glob("*.bin")) == sorted(f"{h}_org-model-x_1_2.bin" for h in hexes)
    assert (ns_dir / hexes[0]).with_name(f"{hexes[0]}_org-model-x_1_2.bin").read_bytes() == data[0]
    assert json.loads((ns_dir / "format.json").read_text())["format_version"] == FORMAT_VERSION
    assert t.stored() == [a.event_hash for a in ann]
    assert all(e.medium == "DISK" for e in t.events)
    assert not list(ns_dir.glob("*.tmp"))


@pytest.mark.parametrize("ns,suffix", [
    (Namespace(model="m", tp_size=4, tp_rank=3), "_m_3_4"),
    (Namespace(model="a/b", tp_size=2, tp_rank=1, is_mla=True), "_a-b"),
    (Namespace(model="m", pp_size=2, pp_rank=1), "_m_0_1_2_1"),
])
def test_file_suffix_matches_hicache_file(ns, suffix):
    assert hicache_suffix(ns) == suffix


def test_a_newer_on_disk_format_is_refused_by_name(tmp_path):
    Tier(tmp_path)
    fmt = tmp_path / f"ns-{NS.digest}" / "format.json"
    fmt.write_text(json.dumps({"format_version": 99}))
    with pytest.raises(DiskError, match="on-disk format version 99 is not 1"):
        Tier(tmp_path)


def test_pages_survive_a_restart_and_are_announced_again(tmp_path):
    t = Tier(tmp_path)
    hexes, ann, data = chain(4)
    t.tier.write(hexes, [memoryview(d) for d in data], ann)
    t.tier.close()
    t2 = Tier(tmp_path)
    t2.tier.scan()
    assert t2.read(hexes) == data
    assert t2.stored() == [a.event_hash for a in ann]
    assert t2.index.statistics().num_unverified == 0


@pytest.mark.parametrize("damage", ["truncate", "flip", "extend"])
def test_a_damaged_page_is_a_counted_miss_and_is_removed(tmp_path, damage):
    t = Tier(tmp_path)
    hexes, ann, data = chain(3)
    t.tier.write(hexes, [memoryview(d) for d in data], ann)
    path = t.tier.path(t.tier.name(hexes[1]))
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(raw[:100])
    elif damage == "flip":
        raw[5000] ^= 0xFF
        path.write_bytes(raw)
    else:
        path.write_bytes(raw + b"x")
    assert t.read(hexes) == data[:1]  # never the damaged bytes
    assert not path.exists() and t.index.statistics().num_corrupt == 1
    removed = [h for e in t.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [ann[1].event_hash]


def test_scan_removes_partial_pages_and_stale_temps_and_leaves_foreign_files(tmp_path):
    t = Tier(tmp_path, stale_temp_age_s=0)
    hexes, ann, data = chain(2)
    t.tier.write(hexes, [memoryview(d) for d in data], ann)
    ns_dir = t.tier.dir
    (ns_dir / ".abandoned.tmp").write_bytes(b"half")
    (ns_dir / "notes.txt").write_text("operator's file")
    t.tier.path(t.tier.name(hexes[1])).write_bytes(b"short")
    t.tier.close()
    t2 = Tier(tmp_path, stale_temp_age_s=0)
    t2.tier.scan()
    assert not (ns_dir / ".abandoned.tmp").exists() and (ns_dir / "notes.txt").exists()
    assert t2.tier.num_stale_temp_removed == 1 and t2.tier.num_foreign == 1
    assert t2.index.statistics().num_corrupt == 1 and t2.read(hexes) == data[:1]


def reachable_from_a_root(index):
    """Every announced page on disk continues a page on disk (or is a root)."""
    entries = index.entries()
    present = {e.announce.event_hash for e in entries if e.announce is not None}
    return all(e.announce is None or e.announce.parent_hash in (None, *present) for e in entries)


def test_max_size_evicts_the_least_recent_chain_tail_first_and_keeps_its_root(tmp_path):
    t = Tier(tmp_path, max_bytes=10 * PAGE, high=0.8, low=0.5)
    old, old_ann, old_data = chain(6, seed=1)
    new, new_ann, new_data = chain(6, seed=2)
    t.tier.write(old, [memoryview(d) for d in old_data], old_ann)
    t.tier.write(new, [memoryview(d) for d in new_data], new_ann)
    stats = t.index.statistics()
    assert stats.num_bytes <= 10 * PAGE and stats.num_evicted >= 2
    kept = t.tier.present(old)
    assert 1 <= kept < 6 and t.index.statistics().num_pages == kept + 6  # the old chain lost its tail only
    assert t.tier.present(new) == 6 and reachable_from_a_root(t.index)
    assert len(list(t.tier.dir.glob("*.bin"))) == stats.num_pages


def test_a_chain_longer_than_max_size_keeps_its_head_and_refuses_the_tail(tmp_path):
    from kvcr.drivers.nvme import Written
    t = Tier(tmp_path, max_bytes=10 * PAGE, high=0.8, low=0.5)
    hexes, ann, data = chain(12)
    outcomes = [t.tier.write_pages(hexes[i:i + 1], [memoryview(data[i])], ann[i:i + 1])[0] for i in range(12)]
    assert outcomes == [Written.WRITTEN] * 10 + [Written.FULL] * 2  # a parent outlives its children
    assert t.tier.present(hexes) == 10 and t.index.num_refused_full == 2 and t.index.num_evicted == 0


def test_a_restart_announces_pages_root_first_whatever_order_they_were_written_in(tmp_path):
    t = Tier(tmp_path)
    hexes, ann, data = chain(6, seed=3)
    for i in reversed(range(6)):  # tails first, as a spill would write them
        t.tier.write(hexes[i:i + 1], [memoryview(data[i])], ann[i:i + 1])
    t.tier.close()
    t2 = Tier(tmp_path)
    t2.tier.scan()
    stored = [e for e in t2.events if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None
    assert [h for e in stored for h in e.block_hashes] == [a.event_hash for a in ann]
    inventory = t2.index.inventory()
    assert len(inventory) == 1 and inventory[0].block_hashes == tuple(a.event_hash for a in ann)


def _race_writer(root, payload_byte, out):
    t = Tier(root)
    hexes, ann, _ = chain(1, seed=42)
    payload = memoryview(bytes([payload_byte]) * PAGE)
    threads = [threading.Thread(target=t.tier.write, args=(hexes, [payload], ann)) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out.put(len(t.stored()))


def test_eight_writers_in_two_processes_leave_one_whole_page_and_one_announcement(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_race_writer, args=(str(tmp_path), b, out)) for b in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert out.get(timeout=5) + out.get(timeout=5) == 1
    files = list((tmp_path / f"ns-{NS.digest}").iterdir())
    pages = [f for f in files if f.suffix == ".bin"]
    assert len(pages) == 1 and pages[0].read_bytes() in (b"\x01" * PAGE, b"\x02" * PAGE)
    assert not [f for f in files if f.name.endswith(".tmp")]


def test_keys_that_are_not_page_hashes_never_reach_the_filesystem(tmp_path):
    cfg = load_config(None, {"runner.name": "esc", "dram.size": "1Mi", "nvme.storage_dir": str(tmp_path),
                             "dram.pools": [{"name": "kv", "page_bytes": PAGE}]})
    store = open_store(cfg)
    try:
        with pytest.raises(ValueError, match="64 lowercase hex"):
            store.runner.key("kv", "../" * 20 + "etc/passwd")
    finally:
        store.shutdown()


# --- the tier inside a runner: spill and promotion ---------------------------------------------------

@pytest.fixture(params=["write_behind", "spill"])
def nvme_runner(tmp_path, request):
    events = []
    cfg = load_config(None, {"runner.name": "nv", "runner.block_size": BLOCK, "dram.size": 8 * PAGE,
                             "dram.pools": [{"name": "kv", "page_bytes": PAGE}], "dram.high_watermark": 0.75,
                             "dram.low_watermark": 0.5, "nvme.storage_dir": str(tmp_path),
                             "nvme.write_policy": request.param})
    store = open_store(cfg, publish=events.extend)
    yield store, events
    store.shutdown()


def test_dram_evicts_only_pages_nvme_holds_and_a_hit_is_promoted_back(nvme_runner):
    store, events = nvme_runner
    runner = store.runner
    hexes, ann, data = chain(8)
    keys = [runner.key("kv", h) for h in hexes]
    runner.put("kv", keys[:7], data[:7], ann[:7])
    pool, disk = runner.pools["kv"], store.lower.disks["kv"]
    # 7 used > 6 (high): down to 4 (low) once written. Spill writes the 3 tails with their ancestors.
    wait_until(lambda: pool.statistics().num_ready == 4, 10, 0.01, "DRAM down to its low watermark")
    assert disk.present(hexes) == 7 and pool.leading_ready(keys) == 4 and not pool.dropped
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "DISK"]
    assert stored[0].parent_block_hash is None and sum(len(e.block_hashes) for e in stored) == 7
    assert runner.get("kv", keys[:7]) == data[:7]  # DRAM run, then promoted NVMe run
    stats = runner.statistics().nvme
    assert stats.promoted == 3 and stats.spilled == 7
    assert store.lower.persister.flush(5) == (0, 0)  # promoted pages are clean: nothing to write again


def test_promotion_refuses_a_corrupt_nvme_page(nvme_runner):
    store, _ = nvme_runner
    runner = store.runner
    hexes, ann, data = chain(2, seed=5)
    keys = [runner.key("kv", h) for h in hexes]
    disk = store.lower.disks["kv"]
    disk.write(hexes, [memoryview(d) for d in data], ann)
    path = disk.path(disk.name(hexes[1]))
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(raw)
    assert runner.get("kv", keys) == data[:1]
    assert runner.pools["kv"].statistics().num_ready == 1  # the bad page never became visible in DRAM


def test_the_free_space_floor_refuses_writes_that_would_cross_it(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    t = Tier(tmp_path, min_free_space=free + (1 << 30))  # already below the floor
    hexes, ann, data = chain(1)
    assert t.tier.write(hexes, [memoryview(d) for d in data], ann) == [False]
    assert t.tier.errors["ENOSPC"] == 1 and t.index.statistics().num_pages == 0


def test_a_failed_write_of_any_kind_leaves_the_key_writable(tmp_path):
    t = Tier(tmp_path)
    hexes, ann, data = chain(1)
    assert t.tier.write(hexes, [memoryview(b"short")], ann) == [False]  # refused, not left "being written"
    assert t.tier.write(hexes, [memoryview(data[0])], ann) == [True]
    assert t.read(hexes) == data


def test_a_page_continuing_nothing_on_disk_takes_free_room_only(tmp_path):
    from kvcr.drivers.nvme import Written
    t = Tier(tmp_path, max_bytes=4 * PAGE, high=1.0, low=0.5)
    hexes, ann, data = chain(4, seed=7)
    t.tier.write(hexes, [memoryview(d) for d in data], ann)
    orphan, orphan_ann, orphan_data = chain(2, seed=8)  # its parent (page 0) is not on disk
    assert t.tier.write_pages(orphan[1:], [memoryview(orphan_data[1])], orphan_ann[1:]) == [Written.FULL]
    assert t.tier.present(hexes) == 4  # nothing reachable was pushed out for it


def test_shutdown_writes_the_pages_spill_had_not_written_yet(tmp_path):
    cfg = load_config(None, {"runner.name": "nv", "runner.block_size": BLOCK, "dram.size": 8 * PAGE,
                             "dram.pools": [{"name": "kv", "page_bytes": PAGE}], "nvme.storage_dir": str(tmp_path),
                             "nvme.write_policy": "spill"})
    store = open_store(cfg)
    runner = store.runner
    hexes, ann, data = chain(4, seed=9)
    runner.put("kv", runner.keys("kv", hexes), data, ann)
    assert runner.pools["kv"].num_dirty == 4 and store.lower.disks["kv"].index.statistics().num_pages == 0
    store.shutdown()
    assert store.lower.shutdown_flush[1:] == (4, 0)
    t = Tier(tmp_path, ns=runner.layouts["kv"].namespace)
    t.tier.scan()
    assert t.read(hexes) == data


def test_a_repeated_write_failure_is_logged_once_per_interval_with_a_count(caplog):
    from kvcr.drivers.io_stats import ThrottledWarning
    now = [0.0]
    w = ThrottledWarning(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="kvcr.drivers.nvme"):
        for _ in range(5):
            w.warn("ENOSPC", "nvme write of %s failed", "p")
        w.warn("EROFS", "nvme write of %s failed", "q")  # another kind: its own budget
        now[0] = 11.0
        w.warn("ENOSPC", "nvme write of %s failed", "r")
    assert [r.getMessage() for r in caplog.records] == [
        "nvme write of p failed", "nvme write of q failed", "nvme write of r failed (4 more like it since the last report)"]


def test_a_runner_configured_for_nvme_but_built_without_its_tier_is_refused_by_name(tmp_path):
    from kvcr.runner import Runner

    cfg = load_config(None, {"runner.name": "nv", "dram.size": "1Mi", "nvme.storage_dir": str(tmp_path),
                             "dram.pools": [{"name": "kv", "page_bytes": PAGE}]})
    with pytest.raises(ValueError, match="open_store"):
        Runner(cfg)
