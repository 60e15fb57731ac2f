"""Our event stream consumed by an unmodified Dynamo 1.6.1 standalone indexer (ai-dynamo-runtime)."""

import signal
import time

import pytest

from kvcr.client import AttachedWriter, ControlClient
from kvcr.proto import messages as m
from tests.helpers import wait_until
from tests.dynamo import Registration, free_port, registered_runner
from tests.pages import BLOCK, pages_for

pytestmark = pytest.mark.dynamo


def _tokens(seed: int, n: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n * BLOCK)]


def test_indexer_counts_stored_then_removed_dram_pages(indexer, runner_factory):
    info = runner_factory(**{"dram.pools": [{"name": "kv", "page_bytes": 4096}]}).start()
    reg = Registration(indexer, info)
    reg.register(info)
    time.sleep(2.0)  # the indexer's SUB connects asynchronously (slow joiner)
    keys, ann, data = pages_for(12, seed=11, page_bytes=4096)
    tokens = [t for a in ann for t in a.token_ids]
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        writer.put("kv", keys, data, ann)
        reg.wait_for(tokens, cpu=12 * BLOCK)
        client.request(m.Remove(pool="kv", keys=keys[9:]))  # k = 3 from the tail: (N - k) x block_size
        reg.wait_for(tokens, cpu=9 * BLOCK)
        # Removing a page in the middle cuts the prefix there: 5 pages remain matchable.
        client.request(m.Remove(pool="kv", keys=keys[5:8]))
        reg.wait_for(tokens, cpu=5 * BLOCK)
        client.request(m.Remove(pool="kv", keys=keys[:2]))
        reg.wait_for(tokens, cpu=0)
        writer.close()


def test_after_a_crash_and_restart_the_indexer_forgets_what_the_dead_runner_held(indexer, runner_factory):
    # Same endpoints across the restart, as a restarted pod would have: the indexer's SUB reconnects.
    proc, info, reg = registered_runner(indexer, runner_factory)
    keys, ann, data = pages_for(6, seed=12, page_bytes=4096)
    tokens = [t for a in ann for t in a.token_ids]
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        writer.put("kv", keys, data, ann)
        writer.close()
        old_seq, _ = client.snapshot()
    reg.wait_for(tokens, cpu=6 * BLOCK)
    proc.stop(signal.SIGKILL)  # no removals announced: only the restart's AllBlocksCleared can fix this

    info2 = proc.start()
    assert info2["endpoints"]["events"] == info["endpoints"]["events"]
    reg.wait_for(tokens, cpu=0)
    with ControlClient(info2["endpoints"]["control"]) as client:
        new_seq, _ = client.snapshot()
        assert new_seq > old_seq
        writer = AttachedWriter(client)
        writer.put("kv", keys[:2], data[:2], ann[:2])
        writer.close()
    reg.wait_for(tokens, cpu=2 * BLOCK)


def test_relayed_engine_and_runner_tiers_survive_either_side_restarting(indexer, runner_factory):
    from tests.engine_stream import FakeEngine

    engine = FakeEngine()
    ports = {"events.endpoint": f"tcp://127.0.0.1:{free_port()}",
             "events.replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    try:
        proc = runner_factory(**{"events.engine_endpoint": engine.pub.bound_endpoint,
                                 "events.engine_replay_endpoint": engine.pub.bound_replay_endpoint,
                                 "dram.pools": [{"name": "kv", "page_bytes": 4096}], **ports})
        info = proc.start()
        reg = Registration(indexer, info)
        reg.register(info)  # the router registers the runner only: one stream per worker
        time.sleep(2.0)
        keys, ann, data = pages_for(4, seed=21, page_bytes=4096)
        tokens = [t for a in ann for t in a.token_ids]
        from kvcr.proto.events import BlockStored
        engine.send(BlockStored(block_hashes=(ann[0].event_hash, ann[1].event_hash), parent_block_hash=None,
                                token_ids=tuple(tokens[:2 * BLOCK]), block_size=BLOCK, medium="GPU"))
        with ControlClient(info["endpoints"]["control"]) as client:
            writer = AttachedWriter(client)
            writer.put("kv", keys, data, ann)
            writer.close()
        q = reg.wait_for(tokens, cpu=4 * BLOCK)
        assert q["gpu"] == 2 * BLOCK

        # Engine restart: its GPU blocks are gone, our DRAM pages stay known.
        old = (engine.pub.bound_endpoint, engine.pub.bound_replay_endpoint)
        engine.close()
        engine = FakeEngine(*old)
        time.sleep(0.5)
        engine.send(BlockStored(block_hashes=(12345,), parent_block_hash=None, token_ids=tuple(range(BLOCK)),
                                block_size=BLOCK, medium="GPU"))
        wait_until(lambda: reg.query(tokens).get("gpu") == 0 and reg.query(tokens).get("cpu") == 4 * BLOCK, 20,
                   0.2, "gpu 0, cpu 64 after the engine restart")

        # Runner crash and restart while the engine keeps its blocks: the engine view is rebuilt.
        engine.send(BlockStored(block_hashes=(ann[0].event_hash,), parent_block_hash=None,
                                token_ids=tuple(tokens[:BLOCK]), block_size=BLOCK, medium="GPU"))
        wait_until(lambda: reg.query(tokens).get("gpu") == BLOCK, 20, 0.2, "gpu 16 before the runner crash")
        proc.stop(signal.SIGKILL)
        proc.start()
        wait_until(lambda: (q := reg.query(tokens)) and q.get("gpu") == BLOCK and q.get("cpu") == BLOCK, 20, 0.2,
                   "gpu 16 (rebuilt from engine replay) and no DRAM pages after the runner restart")
    finally:
        engine.close()
