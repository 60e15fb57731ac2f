"""PagePool and ClaimTable as pure state machines: residency, eviction order, claims, leases."""

import pytest

from kvcr.proto.announce import Announce, announce_request
from kvcr.proto.claims import ClaimError, ClaimLimit, ClaimTable
from kvcr.proto.events import BlockRemoved, BlockStored
from kvcr.proto.keys import request_page_hashes
from kvcr.proto.pool import IN_FLIGHT, PagePool, PageSizeError, PoolExhausted

pytestmark = pytest.mark.pure

BLOCK = 4


def make_pool(slots=8, **kw):
    return PagePool("kv", page_bytes=64, num_slots=slots, block_size=BLOCK, **kw)


def chain(n, start=0, salt=None):
    tokens = list(range(start, start + n * BLOCK))
    return request_page_hashes(tokens, BLOCK, cache_salt=salt), announce_request(tokens, BLOCK, cache_salt=salt)


def store(pool, keys, announces=None):
    pages = pool.begin_fill(keys, announces)
    pool.commit_fill(pages)
    return pages


def test_filling_pages_are_invisible_until_committed():
    pool = make_pool()
    keys, ann = chain(2)
    pages = pool.begin_fill(keys, ann)
    assert pool.leading_ready(keys) == 0 and pool.take_events() == []
    pool.commit_fill(pages)
    assert pool.leading_ready(keys) == 2


def test_commit_publishes_one_coalesced_block_stored_with_parent_links():
    pool = make_pool()
    keys, ann = chain(3)
    store(pool, keys, ann)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == tuple(a.event_hash for a in ann) and event.parent_block_hash is None
    assert len(event.token_ids) == 3 * BLOCK and event.medium == "CPU_TIER1"


def test_pages_without_an_event_hash_are_stored_but_never_announced():
    pool = make_pool()
    keys, _ = chain(2)
    store(pool, keys, None)
    assert pool.leading_ready(keys) == 2 and pool.take_events() == []
    assert pool.key_for_event_hash(123) is None


def test_failed_fill_frees_its_slot_and_announces_nothing():
    pool = make_pool()
    keys, ann = chain(2)
    pages = pool.begin_fill(keys, ann)
    pool.commit_fill(pages, ok=[True, False])
    assert pool.leading_ready(keys) == 1
    assert pool.statistics().num_free == 7
    assert pool.take_events()[0].block_hashes == (ann[0].event_hash,)


def test_present_keys_are_not_refilled():
    pool = make_pool()
    keys, ann = chain(2)
    store(pool, keys, ann)
    assert pool.begin_fill(keys, ann) == [None, None]


def test_lru_evicts_the_tail_of_a_chain_before_its_head():
    pool = make_pool(slots=4)
    keys, ann = chain(4)
    store(pool, keys, ann)
    pool.take_events()
    other, other_ann = chain(1, start=1000)
    store(pool, other, other_ann)
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed[0].block_hashes == (ann[-1].event_hash,)
    assert pool.leading_ready(keys) == 3


def test_reading_a_chain_protects_it_from_eviction():
    pool = make_pool(slots=4)
    a, a_ann = chain(2)
    b, b_ann = chain(2, start=500)
    store(pool, a, a_ann)
    store(pool, b, b_ann)
    pool.touch(a)
    store(pool, *chain(2, start=900))
    assert pool.leading_ready(a) == 2 and pool.leading_ready(b) == 0


def test_watermark_evicts_down_to_the_low_mark():
    pool = make_pool(slots=10, high_watermark=0.8, low_watermark=0.5)
    keys, ann = chain(9)
    store(pool, keys, ann)
    assert pool.statistics().num_ready == 5


def test_exhausted_pool_names_itself_and_keeps_existing_pages():
    pool = make_pool(slots=2)
    table = ClaimTable(max_claim_fraction=1.0)
    keys, ann = chain(2)
    store(pool, keys, ann)
    table.claim(pool, keys, owner="x", lease_s=5, now=0)
    with pytest.raises(PoolExhausted, match="pool 'kv' is full: 1 pages needed, 0 free, 2 claimed"):
        pool.begin_fill(*chain(1, start=77))
    assert pool.leading_ready(keys) == 2


def test_announce_with_wrong_token_count_is_refused():
    pool = make_pool()
    with pytest.raises(PageSizeError, match=r"announces 3 token ids for 1 block\(s\), block_size is 4"):
        pool.begin_fill(["k"], [Announce(event_hash=1, parent_hash=None, token_ids=(1, 2, 3))])


def test_claimed_pages_survive_eviction_and_removal_until_released():
    pool = make_pool(slots=2)
    table = ClaimTable(max_claim_fraction=1.0)
    keys, ann = chain(2)
    store(pool, keys, ann)
    claim = table.claim(pool, keys, owner="peer", lease_s=5, now=0)
    assert pool.remove(keys) == 2
    assert pool.leading_ready(keys) == 0 and pool.statistics().num_discarding == 2
    assert table.release(claim.claim_id, owner="peer").live == (True, True)
    stats = pool.statistics()
    assert stats.num_free == 2 and stats.num_discarding == 0


def test_claim_pins_only_the_leading_present_prefix():
    pool = make_pool()
    keys, ann = chain(4)
    store(pool, keys[:2], ann[:2])
    claim = ClaimTable().claim(pool, keys, owner="o", lease_s=1, now=0)
    assert [p.key for p in claim.pages] == keys[:2]


def test_claims_are_capped_at_the_configured_fraction():
    pool = make_pool(slots=4)
    table = ClaimTable(max_claim_fraction=0.5)
    keys, ann = chain(4)
    store(pool, keys, ann)
    assert len(table.claim(pool, keys, owner="a", lease_s=1, now=0).pages) == 2
    with pytest.raises(ClaimLimit, match="max_claim_fraction 0.5"):
        table.claim(pool, keys[2:], owner="b", lease_s=1, now=0)


def test_lease_expiry_releases_and_renew_extends():
    pool = make_pool()
    table = ClaimTable()
    keys, ann = chain(2)
    store(pool, keys, ann)
    c1 = table.claim(pool, keys, owner="a", lease_s=1.0, now=0.0)
    c2 = table.claim(pool, keys, owner="b", lease_s=1.0, now=0.0)
    table.renew(c2.claim_id, owner="b", now=0.9)
    assert table.expire(1.0) == [c1.claim_id]
    assert pool.num_claimed == 2
    assert table.next_deadline() == pytest.approx(1.9)
    assert table.expire(2.0) == [c2.claim_id] and pool.num_claimed == 0
    late = table.release(c1.claim_id, owner="a")  # answered from the tombstone
    assert late.expired and late.live == (True, True)  # nothing reused the slots meanwhile
    with pytest.raises(ClaimError, match="not held"):
        table.release(c1.claim_id, owner="a")


def test_release_by_another_owner_is_refused():
    pool = make_pool()
    table = ClaimTable()
    keys, ann = chain(1)
    store(pool, keys, ann)
    claim = table.claim(pool, keys, owner="a", lease_s=1, now=0)
    with pytest.raises(ClaimError, match="belongs to 'a'"):
        table.release(claim.claim_id, owner="b")


def test_expired_fill_reservation_frees_its_slots():
    pool = make_pool()
    table = ClaimTable()
    keys, ann = chain(3)
    fill = table.reserve(pool, keys, ann, owner="w", lease_s=1, now=0)
    assert pool.statistics().num_filling == 3
    table.expire(5)
    assert pool.statistics().num_free == 8 and pool.leading_ready(keys) == 0
    with pytest.raises(ClaimError):
        table.commit(fill.fill_id, owner="w", ok=None)


def test_clear_during_fill_discards_the_late_commit():
    pool = make_pool()
    keys, ann = chain(2)
    pages = pool.begin_fill(keys, ann)
    pool.clear()
    pool.commit_fill(pages)
    assert pool.leading_ready(keys) == 0 and pool.statistics().num_free == 8


def test_a_late_release_reports_a_reused_slot_as_not_live():
    pool = make_pool(slots=1)
    table = ClaimTable(max_claim_fraction=1.0)
    keys, ann = chain(1)
    store(pool, keys, ann)
    claim = table.claim(pool, keys, owner="a", lease_s=1, now=0)
    table.expire(2)
    store(pool, *chain(1, start=50))  # the expired page was evicted and its slot reused
    assert table.release(claim.claim_id, owner="a").live == (False,)


def test_in_flight_keys_are_told_apart_from_stored_ones():
    pool = make_pool()
    keys, ann = chain(2)
    store(pool, keys[:1], ann[:1])
    first = pool.begin_fill(keys[1:], ann[1:])
    assert pool.begin_fill(keys, ann) == [None, IN_FLIGHT]
    pool.commit_fill(first, ok=[False])  # the other writer failed: the key is absent again
    assert pool.leading_ready(keys) == 1


def test_a_bad_commit_changes_nothing():
    pool = make_pool()
    table = ClaimTable()
    keys, ann = chain(2)
    fill = table.reserve(pool, keys, ann, owner="w", lease_s=5, now=0)
    for bad in ([True], [True, "yes"]):
        with pytest.raises(PageSizeError, match="one bool per page"):
            table.commit(fill.fill_id, owner="w", ok=bad)
    assert pool.statistics().num_filling == 2
    assert table.commit(fill.fill_id, owner="w", ok=[True, True]) == 2


def test_eviction_is_all_or_nothing():
    pool = make_pool(slots=3)
    table = ClaimTable(max_claim_fraction=1.0)
    a, a_ann = chain(2)
    b, b_ann = chain(1, start=300)
    store(pool, a, a_ann)
    store(pool, b, b_ann)
    table.claim(pool, a, owner="x", lease_s=5, now=0)
    pool.take_events()
    with pytest.raises(PoolExhausted):
        pool.begin_fill(*chain(2, start=600))  # only b is evictable: not enough
    assert pool.leading_ready(b) == 1 and pool.take_events() == []


def test_salted_chain_is_announced_with_salt_and_salted_hashes():
    pool = make_pool()
    keys, ann = chain(2, salt="tenant")
    store(pool, keys, ann)
    (event,) = pool.take_events()
    assert event.cache_salt == "tenant"
    assert event.block_hashes != tuple(a.event_hash for a in chain(2)[1])


def test_quarantined_slots_are_never_reused_but_their_keys_are_free_again():
    pool = make_pool(slots=2)
    keys, ann = chain(2)
    pages = pool.begin_fill(keys[:1], ann[:1])
    assert pool.quarantine_fill(pages) == 1
    stats = pool.statistics()
    assert stats.num_quarantined == 1 and stats.num_free == 1 and stats.num_filling == 0
    store(pool, keys[:1], ann[:1])  # the key can be stored again, in another slot
    assert pool.leading_ready(keys) == 1
    ClaimTable(max_claim_fraction=1.0).claim(pool, keys[:1], owner="o", lease_s=5, now=0)
    with pytest.raises(PoolExhausted):
        pool.begin_fill(*chain(1, start=99))  # the quarantined slot is gone for good


# --- a tier below: DIRTY and CLEAN pages ------------------------------------------------------------

def write_all(pool, keep=None):
    """The writer's round trip: take every dirty page, settle it as `keep` (CLEAN by default)."""
    from kvcr.proto.pool import Keep
    pages = pool.take_dirty(pool.capacity)
    pool.settle_written(pages, [keep or Keep.CLEAN] * len(pages))
    return pages


def test_committed_pages_wait_dirty_for_the_tier_below_oldest_first():
    pool = make_pool(slots=8, lower=True)
    a, a_ann = chain(2)
    b, b_ann = chain(2, start=500)
    pages_a = pool.begin_fill(a, a_ann)
    pool.commit_fill(pages_a, now=1.0)
    store(pool, b, b_ann)
    assert pool.num_dirty == 4 and pool.oldest_dirty_since() == 1.0
    assert [p.key for p in pool.take_dirty(3)] == [*a, b[0]]  # commit order: parents first
    assert pool.num_dirty == 4 and pool.num_writing == 3 and pool.statistics().num_claimed == 0  # not a use


def test_eviction_takes_clean_pages_and_waits_rather_than_drop_dirty_ones():
    from kvcr.proto.pool import Keep, PoolBusy
    pool = make_pool(slots=4, lower=True)
    a, a_ann = chain(2)
    store(pool, a, a_ann)
    write_all(pool)
    b, b_ann = chain(2, start=500)
    store(pool, b, b_ann)
    c, c_ann = chain(2, start=900)
    store(pool, c, c_ann)  # room from the clean pages: nothing lost (NVMe has them)
    assert pool.leading_ready(a) == 0 and pool.leading_ready(b) == 2 and not pool.dropped
    d, d_ann = chain(1, start=1300)
    with pytest.raises(PoolBusy) as busy:
        pool.begin_fill(d, d_ann)  # only dirty pages left
    assert busy.value.shortfall == 1 and pool.leading_ready(b) == 2
    pool.commit_fill(pool.begin_fill(d, d_ann, evict_dirty=True))  # the wait ran out: drop, counted
    assert pool.dropped == {Keep.DIRTY.value: 1} and pool.leading_ready(b) == 1


@pytest.mark.parametrize("keep", ["WRITE_FAILED", "LOWER_FULL"])
def test_a_page_the_tier_below_refused_is_evicted_without_waiting_and_counted_by_reason(keep):
    from kvcr.proto.pool import Keep
    pool = make_pool(slots=2, lower=True)
    a, a_ann = chain(2)
    store(pool, a, a_ann)
    write_all(pool, Keep[keep])
    store(pool, *chain(1, start=500))
    assert pool.dropped == {Keep[keep].value: 1}


def test_a_page_whose_nvme_copy_was_evicted_is_counted_when_dram_drops_it():
    from kvcr.proto.pool import Keep
    pool = make_pool(slots=2, lower=True)
    a, a_ann = chain(2)
    store(pool, a, a_ann)
    write_all(pool)
    pool.mark_unkept(a[1:], Keep.LOWER_EVICTED)
    store(pool, *chain(2, start=500))
    assert pool.dropped == {"nvme_evicted": 1}


def test_spill_order_writes_the_least_recent_tail_with_its_dirty_ancestors_root_first():
    pool = make_pool(slots=8, lower=True)
    a, a_ann = chain(3)
    b, b_ann = chain(2, start=500)
    store(pool, a, a_ann)
    store(pool, b, b_ann)
    assert [p.key for p in pool.take_dirty(1, lru=True)] == a  # LRU: a's tail, whose parents come first


def test_a_pool_without_a_tier_below_counts_every_eviction_as_a_drop():
    pool = make_pool(slots=2)
    store(pool, *chain(2))
    store(pool, *chain(1, start=500))
    assert pool.num_dirty == 0 and pool.dropped == {"no_lower_tier": 1}


def test_a_page_removed_while_the_writer_reads_it_keeps_its_slot_until_the_write_ends():
    from kvcr.proto.pool import Keep
    pool = make_pool(slots=2, lower=True)
    a, a_ann = chain(2)
    store(pool, a, a_ann)
    taken = pool.take_dirty(1)
    assert pool.remove(a) == 2 and pool.statistics().num_free == 1  # the taken page's slot is not reused
    pool.settle_written(taken, [Keep.CLEAN])
    assert pool.statistics().num_free == 2 and pool.statistics().num_discarding == 0
