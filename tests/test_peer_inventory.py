"""PeerInventory: which peer holds which block, from event batches (pure)."""

import pytest

from kvcr.proto.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcr.proto.peer_inventory import PeerInventory

U64 = 2**64


def stored(hashes, medium="CPU_TIER1"):
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None, token_ids=tuple(range(4 * len(hashes))),
                       block_size=4, medium=medium)


def batch(*events):
    return EventBatch(ts=0.0, events=tuple(events))


def test_the_peer_with_the_longest_leading_run_is_the_source_ties_to_the_lower_name():
    inv = PeerInventory()
    inv.apply("tcp://b:1", batch(stored([1, 2, 3])))
    inv.apply("tcp://a:1", batch(stored([1, 2])))
    inv.apply("tcp://c:1", batch(stored([2, 3, 4, 5])))  # no first block: no leading run
    assert inv.best_source([1, 2, 3, 4]) == ("tcp://b:1", 3)
    inv.apply("tcp://a:1", batch(stored([3])))
    assert inv.best_source([1, 2, 3, 4]) == ("tcp://a:1", 3)
    assert inv.best_source([9]) is None


@pytest.mark.parametrize("events, held", [
    ([stored([1]), stored([1], "DISK"), BlockRemoved(block_hashes=(1,), medium="CPU_TIER1")], True),
    ([stored([1]), stored([1], "DISK"), BlockRemoved(block_hashes=(1,), medium="CPU_TIER1"),
      BlockRemoved(block_hashes=(1,), medium="DISK")], False),
    ([stored([1, 2]), AllBlocksCleared()], False),
    ([stored([-1])], True),  # signed int64 on the wire, u64 in lookups
])
def test_a_block_is_held_while_any_medium_holds_it(events, held):
    inv = PeerInventory()
    inv.apply("p", batch(*events))
    lookup = [U64 - 1] if events[0].block_hashes == (-1,) else [1]
    assert (inv.best_source(lookup) is not None) is held


@pytest.mark.parametrize("medium, source", [("GPU", False), (None, False), ("CPU_PINNED", False),
                                            ("CPU_TIER1", True), ("DISK", True)])
def test_only_the_media_a_runner_serves_make_a_peer_a_source(medium, source):
    inv = PeerInventory()
    inv.apply("p", batch(stored([1], medium)))  # a relayed engine tier is not something a runner hands over
    assert (inv.best_source([1]) is not None) is source
