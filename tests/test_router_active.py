"""What requests in flight put on a worker: decode load once per distinct block, and a prefix on
its device before its events say so."""

import pytest

from kvcr.proto.events import BlockStored, EventBatch
from router_hints.active import ActiveBlocks
from router_hints.core import RouterCore, on_device
from router_hints.discovery import Publisher
from router_hints.index import Overlap

pytestmark = pytest.mark.pure

BLOCK = 4
A, B = ("a", 0), ("b", 0)


def test_a_request_sharing_an_active_prefix_adds_only_its_own_blocks():
    active = ActiveBlocks(linger_s=5.0)
    assert active.decode_blocks(A, [1, 2, 3]) == 3
    active.start(A, [1, 2, 3])
    active.start(A, [1, 2, 9])
    assert active.decode_blocks(A, [1, 2, 3, 4]) == 4 + 1  # {1, 2, 3, 9} and the new 4
    assert active.decode_blocks(B, [1, 2]) == 2


@pytest.mark.parametrize("now, depth", [(0.0, 3), (4.9, 3), (5.0, 0)])
def test_an_ended_requests_prefix_counts_as_held_until_its_events_should_have_come(now, depth):
    active = ActiveBlocks(linger_s=5.0)
    active.start(A, [1, 2, 3])
    assert active.held_depth(A, [1, 2, 3, 4], now=0.0) == 3
    active.finish(A, [1, 2, 3], now=0.0)
    active.expire(now)
    assert active.held_depth(A, [1, 2, 3, 4], now=now) == depth
    assert active.decode_blocks(A, [1]) == 1  # ended: no longer load


def test_a_block_two_requests_hold_stays_active_until_both_end():
    active = ActiveBlocks(linger_s=0.0)
    active.start(A, [1, 2])
    active.start(A, [1, 3])
    active.finish(A, [1, 2], now=1.0)
    assert active.held_depth(A, [1, 3], now=1.0) == 2 and active.held_depth(A, [2], now=1.0) == 0


@pytest.fixture
def core():
    clock = [0.0]
    core = RouterCore(block_size=BLOCK, clock=lambda: clock[0])
    for name in ("a", "b"):
        core.add(Publisher(name, 0, BLOCK, f"ipc:///tmp/kvcr-test-{name}-absent", None, None))
    yield core, clock
    core.close()


def test_the_next_request_of_a_prefix_in_flight_follows_it_to_the_same_worker(core):
    core, clock = core
    tokens = list(range(8 * BLOCK))
    first = core.route(tokens, pinned=B)  # B is computing the prefix; nobody has published it yet
    core.active.start(B, list(first.seq_hashes))
    again = core.route(tokens + [1, 2, 3, 4])
    assert again.choice.worker == B and again.overlaps[B].device == 8 and again.hint is None
    # The request ends; until B's events catch up its device still counts, then only what they say.
    core.active.finish(B, list(first.seq_hashes), clock[0])
    clock[0] = 4.0
    assert core.route(tokens).choice.worker == B
    clock[0] = 6.0
    assert B not in core.route(tokens).overlaps


def test_a_target_computing_the_prefix_already_is_not_hinted_to_pull_it(core):
    core, _ = core
    tokens = list(range(8 * BLOCK))
    events = (BlockStored(block_hashes=tuple(range(100, 108)), parent_block_hash=None, token_ids=tuple(tokens),
                          block_size=BLOCK, medium="CPU_TIER1"),)
    core.index.apply("a", EventBatch(ts=0.0, events=events, dp_rank=0))
    core.publishers[A] = Publisher("a", 0, BLOCK, "ipc:///tmp/kvcr-test-a-absent", None, "tcp://127.0.0.1:9")
    route = core.route(tokens, pinned=B)
    assert route.hint is not None  # A's runner holds what B lacks
    core.active.start(B, list(route.seq_hashes))
    assert core.route(tokens, pinned=B).hint is None  # B is computing it already


def test_a_request_that_failed_leaves_no_prefix_behind():
    active = ActiveBlocks(linger_s=5.0)
    active.start(A, [1, 2])
    active.finish(A, [1, 2], now=0.0, computed=False)
    assert active.held_depth(A, [1, 2], now=0.0) == 0


@pytest.mark.parametrize("held, ahead, expected", [
    (Overlap(dram=10, runner=10), 10, Overlap(device=10, runner=10)),
    (Overlap(device=2, host=3, dram=5, runner=5), 4, Overlap(device=4, host=1, dram=5, runner=5)),
    (Overlap(disk=3, runner=3), 6, Overlap(device=6, runner=3)),
])
def test_a_prefix_in_flight_is_scored_as_on_device_whatever_else_holds_it(held, ahead, expected):
    assert on_device(held, ahead) == expected
