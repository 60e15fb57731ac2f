"""What a runner tells routers it holds, and what it finds when a peer takes it at its word."""

import pytest

from kvcr.config import load_config
from kvcr.proto.keys import hash_str_to_int64
from kvcr.runner import Runner


@pytest.fixture
def small_runner():
    """A runner whose DRAM holds 4 pages of 4 KiB, with no NVMe below: a fifth page evicts one."""
    r = Runner(load_config(None, {"runner.name": "truth", "dram.size": str(4 * 4096),
                                  "dram.pools": [{"name": "kv", "page_bytes": 4096}]}))
    yield r
    r.shutdown()


def hexes(*names):
    return [f"{n:064x}" for n in names]


def test_a_peer_claiming_pages_we_let_go_or_never_had_is_counted_apart(small_runner):
    r = small_runner
    stored = r.keys("kv", hexes(*range(1, 6)))
    for key in stored:  # one at a time, the oldest is evicted to make room for the fifth
        r.put("kv", [key], [b"\x01" * 4096])
    assert r.tiers("kv", stored[:1]) == [0]
    grant = r.grant("kv", [stored[4], stored[0], *r.keys("kv", hexes(90, 91))], owner="peer")
    r.release(grant.claim.claim_id, owner="peer")
    stats = r.statistics()
    assert len(grant.claim.pages) == 1
    assert (stats.unheld_evicted, stats.unheld_never_held) == (1, 2)


def test_a_claim_for_pages_we_hold_counts_nothing(small_runner):
    r = small_runner
    keys = r.keys("kv", hexes(1, 2))
    r.put("kv", keys, [b"\x01" * 4096] * 2)
    r.release(r.grant("kv", keys, owner="peer").claim.claim_id, owner="peer")
    stats = r.statistics()
    assert (stats.unheld_evicted, stats.unheld_never_held) == (0, 0)
