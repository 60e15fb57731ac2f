"""The adapter's pure parts: the claims a destination holds (a read collects only the claim on exactly its keys),
restorable prefixes per hit policy, page announces."""

import pytest

from dataclasses import dataclass

from kvcr.proto.claim_ledger import ClaimLedger, HeldClaim
from kvcr.proto.keys import event_hashes, page_hashes, storage_namespace_seed
from sglang_adapter.pagemeta import AnnounceChain, restorable

pytestmark = pytest.mark.pure


@dataclass(frozen=True)
class Lease:
    """A confirmation's lease, without the claim behind it (the pull decides lease_over)."""

    deadline: float

    def lease_over(self, now: float) -> bool:
        return now >= self.deadline


def claim(run: list[str], deadline: float = 5.0) -> HeldClaim:
    return HeldClaim(conf=Lease(deadline), page_hexes=run)


def test_two_requests_sharing_a_first_key_never_collect_each_others_claim():
    claims = ClaimLedger()
    a, b = claim(["k0", "a1", "a2"]), claim(["k0", "b1", "b2"])
    claims.add(a)
    claims.add(b)
    assert claims.covered(["k0", "a1", "a2", "x"], 0) == 3
    assert claims.take(["k0", "b1", "b2"], 0) is b
    assert claims.take(["k0", "b1", "b2"], 0) is None  # collected once
    assert claims.take(["k0", "a1"], 0) is a           # a shorter read takes the claim on its prefix
    assert len(claims) == 0


def test_chained_claims_cover_a_long_request_and_expire_or_drain():
    claims = ClaimLedger()
    first, second = claim(["p0", "p1"], deadline=5.0), claim(["p2", "p3"], deadline=15.0)
    claims.add(first)
    claims.add(second)
    assert claims.covered(["x", "p0", "p1", "p2", "p3"], 1) == 5
    assert claims.expire(now=12.0) == [first]
    assert claims.take_starting_in(["p2"], None) == [second]
    claims.add(claim(["q0"]))
    assert len(claims.drain()) == 1 and len(claims) == 0


def test_a_claim_two_requests_count_on_goes_back_only_when_both_ended():
    claims = ClaimLedger()
    shared = HeldClaim(conf=Lease(5.0), page_hexes=["s0", "s1"], owners={"rid-a"})
    claims.add(shared)
    assert claims.covered(["s0", "s1"], 0, "rid-b") == 2  # B's query counts on A's claim
    assert claims.take_starting_in(["s0", "s1"], "rid-a") == []  # A revoked: B still needs it
    assert claims.take_starting_in(["s0"], "rid-c") == []        # a request that never counted on it
    assert claims.take(["s0", "s1"], 0) is shared and shared.owners == {"rid-b"}
    claims.add(shared)
    assert claims.take_starting_in(["s0", "s1"], "rid-b") == [shared] and len(claims) == 0


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
    anns = AnnounceChain(4).announces(keys, {"token_ids": list(range(8)), "parent_key": parent}, None)
    assert [a.token_ids for a in anns] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert anns[1].parent_hash == anns[0].event_hash and anns[0].parent_hash is not None
    assert AnnounceChain(4).announces(keys, {"token_ids": list(range(7))}, None) is None


@pytest.mark.parametrize("extra_key, cache_salt", [(None, None), ("lora-a", None), (None, "salt"), ("lora-a", "s")])
def test_announced_hashes_are_the_ones_the_engine_publishes_for_salted_and_lora_requests(extra_key, cache_salt):
    tokens = list(range(300, 300 + 5 * 4))
    seed = storage_namespace_seed(extra_key, cache_salt)
    keys = page_hashes(tokens, 4, seed.hex() if seed else None)  # SGLang's storage keys for this request
    chain = AnnounceChain(4)
    ns = {"extra_key": extra_key, "cache_salt": cache_salt}
    first = chain.announces(keys[:2], {"token_ids": tokens[:8], **ns}, [])
    rest = chain.announces(keys[2:], {"token_ids": tokens[8:], **ns}, keys[:2])  # a later node: its parent
    got = [a.event_hash for a in first + rest]
    assert got == event_hashes(tokens, 4, extra_key=extra_key, cache_salt=cache_salt)
    assert rest[0].parent_hash == first[-1].event_hash
    assert {(a.lora_name, a.cache_salt) for a in first + rest} == {(extra_key, cache_salt)}


def test_a_salted_chain_whose_parent_was_never_stored_here_is_not_announced():
    tokens = list(range(20))
    assert AnnounceChain(4).announces(["ab" * 32], {"token_ids": tokens[:4], "cache_salt": "s"},
                                      ["cd" * 32]) is None


@pytest.mark.parametrize("owners, held", [({"rid-late"}, False), ({"rid-late", "rid-live"}, True), ({None}, True)])
def test_a_claim_granted_after_its_prefetch_ended_is_not_held(owners, held):
    claims = ClaimLedger()
    assert claims.take_starting_in(["g0"], "rid-late") == []  # the prefetch ended before the grant came
    assert claims.add(HeldClaim(conf=Lease(5.0), page_hexes=["g0", "g1"], owners=set(owners))) is held
    assert len(claims) == int(held)


def test_a_request_prefetching_again_under_the_same_id_gets_its_grants_held():
    # SGLang retries a prefetch (and re-prefetches a retracted request) under the same rid.
    claims = ClaimLedger()
    claims.take_starting_in(["r0"], "rid-retry")  # the first prefetch ended
    claims.started("rid-retry")                   # the retry's hit query begins
    assert claims.add(HeldClaim(conf=Lease(5.0), page_hexes=["r0"], owners={"rid-retry"}))



def test_a_claim_holder_keeps_the_ledger_without_opening_its_puller_until_a_claim_is_made():
    from kvcr.drivers.claim_holder import ClaimHolder

    made = []
    holder = ClaimHolder(lambda: made.append("puller"))
    holder.prefetch_ended(["k0"], "rid-gone")  # recorded: a grant for it that comes later goes back at once
    assert holder.covered(["k0", "k1"], 0, "rid-live") == 0 and holder.expire() == 0 and len(holder) == 0
    holder.close()
    assert not holder.has_puller and made == []
