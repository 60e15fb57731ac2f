"""The adapter's pure parts: pending claims (a read collects only the claim on exactly its keys),
restorable prefixes per hit policy, page announces."""

import pytest

from kvcr.proto.keys import page_hashes
from sglang_adapter.pagemeta import page_announces, restorable
from sglang_adapter.pending import Pending, PendingClaims


def claim(run: list[str], since: float = 0.0) -> Pending:
    return Pending(conf=object(), page_hexes=run, since=since)


def test_two_requests_sharing_a_first_key_never_collect_each_others_claim():
    claims = PendingClaims()
    a, b = claim(["k0", "a1", "a2"]), claim(["k0", "b1", "b2"])
    claims.add(a)
    claims.add(b)
    assert claims.covered(["k0", "a1", "a2", "x"], 0) == 3
    assert claims.take(["k0", "b1", "b2"], 0) is b
    assert claims.take(["k0", "b1", "b2"], 0) is None  # collected once
    assert claims.take(["k0", "a1"], 0) is a           # a shorter read takes the claim on its prefix
    assert len(claims) == 0


def test_chained_claims_cover_a_long_request_and_expire_or_drain():
    claims = PendingClaims()
    first, second = claim(["p0", "p1"], since=0.0), claim(["p2", "p3"], since=10.0)
    claims.add(first)
    claims.add(second)
    assert claims.covered(["x", "p0", "p1", "p2", "p3"], 1) == 5
    assert claims.expire(now=12.0, ttl_s=5.0) == [first]
    assert claims.take_starting_in(["p2"]) == [second]
    claims.add(claim(["q0"]))
    assert len(claims.drain()) == 1 and len(claims) == 0


@pytest.mark.parametrize("held, policy, trailing, expected", [
    ([True, True, False, True], "all_pages", 1, {1, 2}),
    ([False, True, False, True], "trailing_pages", 1, {2, 4}),
    ([True, True, False, True], "trailing_pages", 2, {1, 2}),
    ([], "all_pages", 1, set()),
])
def test_restorable_prefixes_follow_the_pools_hit_policy(held, policy, trailing, expected):
    assert restorable(held, policy, trailing) == expected


def test_announces_chain_from_the_parent_and_need_every_token():
    parent, *keys = page_hashes(list(range(100, 112)), 4)
    anns = page_announces(keys, list(range(8)), 4, parent_key=parent)
    assert [a.token_ids for a in anns] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert anns[1].parent_hash == anns[0].event_hash and anns[0].parent_hash is not None
    assert page_announces(keys, list(range(7)), 4, None) is None
