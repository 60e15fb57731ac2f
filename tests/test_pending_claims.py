"""PendingClaims: a read collects only the claim on exactly its keys (pure, no sockets)."""

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
