"""Relaying the engine's event stream: one stream per worker that survives either side restarting."""

import signal
import time

import pytest

from kvcr.client import AttachedWriter, ControlClient
from kvcr.proto.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcr.proto.relay import EngineMirror
from kvcr.drivers.zmq_subscriber import Delivery, Subscriber
from tests.helpers import wait_until
from tests.engine_stream import FakeEngine
from tests.pages import BLOCK, pages_for


def gpu_stored(hashes, parent=None, block_size=BLOCK, medium="GPU"):
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent,
                       token_ids=tuple(range(block_size * len(hashes))), block_size=block_size, medium=medium)


def batch(*events):
    return EventBatch(ts=0.0, events=events, dp_rank=0)


# --- the pure mirror -------------------------------------------------------------------------------

def test_in_order_batches_are_forwarded_and_mirrored():
    mirror = EngineMirror(block_size=BLOCK)
    step = mirror.on_batch(0, batch(gpu_stored([1, 2])))
    assert not step.resync and step.events == (gpu_stored([1, 2]),)
    mirror.on_batch(1, batch(BlockRemoved(block_hashes=(2,), medium="GPU")))
    assert [e.block_hashes for e in mirror.inventory()] == [(1,)]


def test_an_engine_restart_resyncs_and_forgets_engine_blocks():
    mirror = EngineMirror(block_size=BLOCK)
    mirror.on_batch(0, batch(gpu_stored([1])))
    mirror.on_batch(1, batch(gpu_stored([2], parent=1)))
    step = mirror.on_batch(0, batch(gpu_stored([9])))
    assert step.resync and step.problem == "engine restarted" and step.events == (gpu_stored([9]),)
    assert [e.block_hashes for e in mirror.inventory()] == [(9,)]


def test_an_engine_clear_becomes_a_resync_and_drops_what_came_before_it():
    mirror = EngineMirror(block_size=BLOCK)
    mirror.on_batch(0, batch(gpu_stored([1])))
    step = mirror.on_batch(1, batch(gpu_stored([2]), AllBlocksCleared(), gpu_stored([3])))
    assert step.resync and step.events == (gpu_stored([3]),)
    assert [e.block_hashes for e in mirror.inventory()] == [(3,)]


def test_a_gap_asks_for_replay_and_a_replay_that_misses_it_resyncs():
    mirror = EngineMirror(block_size=BLOCK)
    mirror.on_batch(0, batch(gpu_stored([1])))
    assert mirror.on_batch(5, batch(gpu_stored([6]))).replay_from == 1
    steps = mirror.after_replay([(3, batch(gpu_stored([4]))), (4, batch(gpu_stored([5])))], 1, 5,
                                batch(gpu_stored([6])))
    assert steps[0].resync and "[1, 3) could not be replayed" in steps[0].problem
    assert [s.events[0].block_hashes for s in steps[1:]] == [(4,), (5,), (6,)]
    assert [e.block_hashes[0] for e in mirror.inventory()] == [4, 5, 6]
    assert mirror.on_batch(6, batch(gpu_stored([7]))).events == (gpu_stored([7]),)  # in order again


def test_a_replay_that_never_answers_resyncs_and_the_stream_moves_on():
    mirror = EngineMirror(block_size=BLOCK)
    mirror.on_batch(0, batch(gpu_stored([1])))
    steps = mirror.after_replay([], 1, 9, batch(gpu_stored([9])))
    assert steps[0].resync and steps[-1].events == (gpu_stored([9]),)
    assert mirror.on_batch(10, batch(gpu_stored([10]))).replay_from == -1


def test_a_filled_gap_forwards_the_missing_batches_in_order():
    mirror = EngineMirror(block_size=BLOCK)
    mirror.on_batch(0, batch(gpu_stored([1])))
    steps = mirror.after_replay([(1, batch(gpu_stored([2]))), (2, batch(gpu_stored([3])))], 1, 3,
                                batch(gpu_stored([4])))
    assert [s.events[0].block_hashes for s in steps] == [(2,), (3,), (4,)] and not any(s.resync for s in steps)
    assert mirror.on_batch(2, batch(gpu_stored([3]))).events == ()  # a late live copy is stale


def test_a_restart_whose_first_batch_was_lost_is_still_a_restart():
    mirror = EngineMirror(block_size=BLOCK)
    for seq in range(5):
        mirror.on_batch(seq, batch(gpu_stored([seq + 100])))
    step = mirror.on_batch(1, batch(gpu_stored([7])))  # the new engine's seq 0 never arrived
    assert step.resync and step.problem == "engine restarted"


def test_a_block_size_mismatch_is_refused_by_name():
    mirror = EngineMirror(block_size=BLOCK)
    step = mirror.on_batch(0, batch(gpu_stored([1], block_size=32)))
    assert step.events == () and "engine block_size 32 != runner.block_size 16" in step.problem


@pytest.mark.parametrize("first_seq,complete", [(0, True), (3, False), (None, True)])
def test_rebuild_is_trusted_only_from_seq_zero(first_seq, complete):
    mirror = EngineMirror(block_size=BLOCK)
    replayed = [] if first_seq is None else [(first_seq, batch(gpu_stored([1])))]
    assert mirror.rebuild(replayed) is complete
    assert len(mirror.inventory()) == (1 if complete and replayed else 0)


def test_repeated_stores_are_reference_counted():
    mirror = EngineMirror(block_size=BLOCK)
    mirror.on_batch(0, batch(gpu_stored([1])))
    mirror.on_batch(1, batch(gpu_stored([1])))
    mirror.on_batch(2, batch(BlockRemoved(block_hashes=(1,), medium="GPU")))
    assert len(mirror.inventory()) == 1


# --- holding engine blocks back until the runner holds them ----------------------------------------

@pytest.fixture
def gated():
    """A mirror holding engine blocks back for 5 s, over a runner whose pages are `held`."""
    held: set[int] = set()
    return EngineMirror(block_size=BLOCK, hold_s=5.0, runner_holds=held.__contains__), held


def test_an_engine_block_waits_for_the_runners_copy_and_follows_it(gated):
    mirror, held = gated
    assert mirror.on_batch(0, batch(gpu_stored([1, 2])), now=0.0).events == ()
    assert mirror.inventory() == [] and mirror.runner_stored([7], now=0.1) == ()
    held.add(1)
    assert [e.block_hashes for e in mirror.runner_stored([1], now=0.2)] == [(1,)]
    held.add(2)
    shown = mirror.runner_stored([2], now=0.3)
    assert [(e.block_hashes, e.parent_block_hash) for e in shown] == [((2,), 1)]
    assert [e.block_hashes for e in mirror.inventory()] == [(1,), (2,)]
    # Already held when the engine stores it: the event goes out as it came.
    held.add(3)
    assert mirror.on_batch(1, batch(gpu_stored([3], parent=2)), now=0.4).events == (gpu_stored([3], parent=2),)


def test_a_child_waits_for_its_parent_even_when_the_runner_holds_it(gated):
    mirror, held = gated
    mirror.on_batch(0, batch(gpu_stored([1]), gpu_stored([2], parent=1)), now=0.0)
    held.add(2)
    assert mirror.runner_stored([2], now=0.1) == ()  # the router would drop a child of an unknown parent
    held.add(1)
    assert [e.block_hashes for e in mirror.runner_stored([1], now=0.2)] == [(1,), (2,)]


@pytest.mark.parametrize("removed_before_shown", [True, False])
def test_a_held_back_block_is_shown_after_hold_s_or_never_if_the_engine_drops_it(gated, removed_before_shown):
    mirror, _ = gated
    mirror.on_batch(0, batch(gpu_stored([1])), now=0.0)
    assert mirror.expire(4.9) == ()
    if removed_before_shown:
        assert mirror.on_batch(1, batch(BlockRemoved(block_hashes=(1,), medium="GPU")), now=1.0).events == ()
        assert mirror.expire(5.0) == () and mirror.blocks == {}
    else:
        assert [e.block_hashes for e in mirror.expire(5.0)] == [(1,)]
        removed = mirror.on_batch(1, batch(BlockRemoved(block_hashes=(1,), medium="GPU")), now=6.0).events
        assert removed == (BlockRemoved(block_hashes=(1,), medium="GPU"),)


def test_the_router_hears_of_a_block_once_and_of_its_removal_when_the_last_copy_goes(gated):
    mirror, held = gated
    held.add(1)
    mirror.on_batch(0, batch(gpu_stored([1])), now=0.0)
    assert mirror.on_batch(1, batch(gpu_stored([1])), now=0.1).events == ()  # as a snapshot would: once
    gone = batch(BlockRemoved(block_hashes=(1,), medium="GPU"))
    assert mirror.on_batch(2, gone, now=0.2).events == ()
    assert mirror.on_batch(3, gone, now=0.3).events == gone.events and mirror.inventory() == []


def test_the_removal_of_a_block_the_mirror_never_held_is_not_relayed():
    mirror = EngineMirror(block_size=BLOCK)
    mirror.on_batch(0, batch(gpu_stored([1])))
    step = mirror.on_batch(1, batch(BlockRemoved(block_hashes=(7, 1), medium="CPU_PINNED"),
                                    BlockRemoved(block_hashes=(7, 1), medium="GPU")))
    assert step.events == (BlockRemoved(block_hashes=(1,), medium="GPU"),)


def test_engine_media_are_held_apart(gated):
    mirror, held = gated
    held.add(1)
    host = gpu_stored([1], medium="CPU_PINNED")
    assert mirror.on_batch(0, batch(gpu_stored([1]), host), now=0.0).events == (gpu_stored([1]), host)
    assert sorted(mirror.blocks) == [("CPU_PINNED", 1), ("GPU", 1)]


# --- a runner relaying a live engine stream ------------------------------------------------------------

def deliveries(sub, until, timeout_s=10.0):
    got = []
    wait_until(lambda: (got.extend(x for x in sub.poll(100) if isinstance(x, Delivery)), until(got))[1],
               timeout_s, message="relayed events")
    return got


def events_of(items):
    return [e for d in items for e in d.batch.events]


def test_runner_merges_engine_and_own_events_into_one_stream(runner_factory):
    engine = FakeEngine()
    try:
        proc = runner_factory(**{"events.engine_endpoint": engine.pub.bound_endpoint,
                                 "events.engine_replay_endpoint": engine.pub.bound_replay_endpoint,
                                 "events.engine_hold_s": 1.0, "dram.pools": [{"name": "kv", "page_bytes": 4096}]})
        info = proc.start()
        sub = Subscriber()
        sub.add("r", info["endpoints"]["events"], info["endpoints"]["replay"])
        time.sleep(1.0)
        keys, ann, data = pages_for(2, page_bytes=4096)
        engine.send(gpu_stored([ann[0].event_hash]))
        time.sleep(0.3)
        with ControlClient(info["endpoints"]["control"]) as client:
            writer = AttachedWriter(client)
            writer.put("kv", keys, data, ann)
            writer.close()
        got = deliveries(sub, lambda g: sum(isinstance(e, BlockStored) for e in events_of(g)) >= 2)
        # The engine's block waited for our copy, then went out right behind it, in one batch.
        stores = [(d.seq, e.medium) for d in got for e in d.batch.events if isinstance(e, BlockStored)]
        assert [m for _, m in stores] == ["CPU_TIER1", "GPU"] and stores[0][0] == stores[1][0]
        seqs = [d.seq for d in got]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

        # The engine restarts (seq from 0 again): its GPU block is gone, our DRAM pages are re-announced;
        # its new block, which we never get, is shown once engine_hold_s has passed.
        engine.close()
        engine = FakeEngine(endpoint=engine.pub.bound_endpoint, replay=engine.pub.bound_replay_endpoint)
        time.sleep(0.5)
        engine.send(gpu_stored([777]))
        got = deliveries(sub, lambda g: any(isinstance(e, AllBlocksCleared) for e in events_of(g))
                         and any(isinstance(e, BlockStored) and e.medium == "GPU" for e in events_of(g)))
        after = events_of(got)
        clear_at = next(i for i, e in enumerate(after) if isinstance(e, AllBlocksCleared))
        rest = after[clear_at + 1:]
        assert [e.medium for e in rest if isinstance(e, BlockStored)] == ["CPU_TIER1", "GPU"]
        assert [h for e in rest if isinstance(e, BlockStored) for h in e.block_hashes] == \
            [a.event_hash for a in ann] + [777]
        sub.close()
    finally:
        engine.close()


def test_a_restarted_runner_rebuilds_the_engine_view_from_replay(runner_factory):
    engine = FakeEngine()
    try:
        proc = runner_factory(**{"events.engine_endpoint": engine.pub.bound_endpoint,
                                 "events.engine_replay_endpoint": engine.pub.bound_replay_endpoint})
        proc.start()
        engine.send(gpu_stored([10, 11]))
        engine.send(BlockRemoved(block_hashes=(11,), medium="GPU"))
        engine.send(gpu_stored([12], parent=10))
        time.sleep(0.5)
        proc.stop(signal.SIGKILL)
        info = proc.start()
        sub = Subscriber()
        sub.add("r", info["endpoints"]["events"], info["endpoints"]["replay"])
        sub.start_after("r", 0)
        got = deliveries(sub, lambda g: sum(isinstance(e, BlockStored) for e in events_of(g)) >= 2)
        stored = [e for e in events_of(got) if isinstance(e, BlockStored)]
        assert isinstance(events_of(got)[0], AllBlocksCleared)
        assert [(e.block_hashes, e.parent_block_hash) for e in stored] == [((10,), None), ((12,), 10)]
        sub.close()
    finally:
        engine.close()


def test_live_batches_older_than_a_snapshot_are_stale_not_a_restart():
    from kvcr.proto.stream import StreamTracker, Verdict
    tracker = StreamTracker()
    tracker.start_after_snapshot(50)
    assert tracker.observe(49)[0] is Verdict.STALE
    assert tracker.observe(51)[0] is Verdict.DELIVER
    assert tracker.observe(3, starts_with_clear=True)[0] is Verdict.RESTART
