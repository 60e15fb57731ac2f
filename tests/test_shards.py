"""Pages assembled from TP shards in one runner (a sidecar's pool): visible only when every shard
is in, discarded when one fails or never comes."""

import threading

import pytest

from kvcr.config import load_config
from kvcr.proto.announce import announce_request
from kvcr.proto.events import BlockStored
from kvcr.proto.keys import page_hashes
from kvcr.proto.shards import ShardError
from kvcr.runner import open_store

SHARD = 4096


@pytest.fixture
def sidecar(tmp_path):
    clock = [0.0]
    events = []
    cfg = load_config(None, {"runner.name": "sidecar-test", "runner.state_dir": str(tmp_path), "dram.size": "1Mi",
                             "runner.lease_seconds": 5.0,
                             "dram.pools": [{"name": "kv", "page_bytes": 2 * SHARD, "shards": 2}]})
    store = open_store(cfg, publish=events.extend, clock=lambda: clock[0])
    yield store, clock, events
    store.shutdown()


def keys_and_announces(n: int, seed: int):
    tokens = list(range(seed, seed + 16 * n))
    return page_hashes(tokens, 16), announce_request(tokens, 16)


def write_shard(store, keys, shard, announces=None, byte=0):
    runner = store.runner
    fill, shard_offset = store.shards.reserve("kv", [runner.key("kv", k) for k in keys], shard, announces)
    for page in fill.pages:
        start = runner.offset("kv", page.slot) + shard_offset
        runner.view[start:start + SHARD] = bytes([byte]) * SHARD
    return fill.fill_id


def test_a_page_appears_and_is_announced_only_once_every_shard_is_in(sidecar):
    store, _, events = sidecar
    runner = store.runner
    keys, ann = keys_and_announces(3, seed=1)
    rkeys = [runner.key("kv", k) for k in keys]
    fill_id = write_shard(store, keys, 0, ann, byte=1)
    assert store.shards.commit(fill_id, 0, True) is None and runner.lookup("kv", rkeys) == 0
    assert not [e for e in events if isinstance(e, BlockStored)]
    assert write_shard(store, keys, 1, byte=2) == fill_id  # the second rank joins the same fill
    assert store.shards.commit(fill_id, 1, True) is True
    assert runner.lookup("kv", rkeys) == 3
    page = runner.get("kv", rkeys[:1])[0]
    assert page == bytes([1]) * SHARD + bytes([2]) * SHARD
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == [a.event_hash for a in ann]


@pytest.mark.parametrize("how", ["a shard fails", "a rank never commits"])
def test_a_missing_shard_discards_the_whole_page(sidecar, how):
    store, clock, _ = sidecar
    runner = store.runner
    keys, _ = keys_and_announces(2, seed=50)
    rkeys = [runner.key("kv", k) for k in keys]
    fill_id = write_shard(store, keys, 0)
    store.shards.commit(fill_id, 0, True)
    write_shard(store, keys, 1)
    if how == "a shard fails":
        assert store.shards.commit(fill_id, 1, False) is False
    else:
        clock[0] += 6.0  # past the fill's lease
        store.housekeeping()
    assert runner.lookup("kv", rkeys) == 0 and len(store.shards) == 0
    assert runner.claims.statistics().num_fills == 0
    assert runner.pools["kv"].statistics().num_free == runner.pools["kv"].capacity


@pytest.mark.parametrize("shard, problem", [(2, "outside 0..1"), (0, "already writes")])
def test_a_shard_out_of_range_or_twice_is_refused(sidecar, shard, problem):
    store, _, _ = sidecar
    keys, _ = keys_and_announces(1, seed=90)
    write_shard(store, keys, 0)
    with pytest.raises(ShardError, match=problem):
        write_shard(store, keys, shard)


def test_ranks_reserving_one_batch_at_once_join_a_single_fill(sidecar):
    """Every rank races for the same batch many times: exactly one fill is opened per batch."""
    store, _, _ = sidecar
    runner = store.runner
    barrier = threading.Barrier(2)
    for seed in range(100, 140):
        keys, _ = keys_and_announces(2, seed=seed * 8)
        got = [None, None]

        def rank(shard):
            barrier.wait()
            got[shard] = write_shard(store, keys, shard, byte=shard + 1)

        threads = [threading.Thread(target=rank, args=(s,)) for s in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert got[0] == got[1] is not None
        assert store.shards.commit(got[0], 0, True) is None and store.shards.commit(got[0], 1, True) is True
        rkeys = [runner.key("kv", k) for k in keys]
        assert runner.get("kv", rkeys[:1])[0] == bytes([1]) * SHARD + bytes([2]) * SHARD
    assert len(store.shards) == 0 and runner.claims.statistics().num_fills == 0
