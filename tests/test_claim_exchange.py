"""A whole peer claim in memory, both ends as pure state machines (h11's pair tests): the source's
`ClaimSource` over a real PagePool and ClaimTable, the destination's `Pull`, bytes moved between two
buffers by the GETs the pull plans. No process, no socket: every exit path of a claim, end to end."""

from dataclasses import replace

import pytest

from kvcr.proto import messages as m
from kvcr.proto.announce import announce_request
from kvcr.proto.claims import ClaimTable
from kvcr.proto.keys import request_page_hashes
from kvcr.proto.pool import PagePool
from kvcr.proto.pull import (BackOff, Finish, Pull, PullState, PullTerms, SendRelease, SourceTerms, Transfer,
                             late_grant_release)
from kvcr.proto.source import ClaimSource

pytestmark = pytest.mark.pure

PAGE, SLOTS, BLOCK, LEASE = 64, 8, 4, 2.0
INCARNATION = "source-1"


class Source:
    """A source runner reduced to its decisions and its region's bytes."""

    def __init__(self, *, can_move: bool = False) -> None:
        self.pool = PagePool("kv", page_bytes=PAGE, num_slots=SLOTS, block_size=BLOCK)
        self.table = ClaimTable(max_claim_fraction=1.0)
        self.claims = ClaimSource(self.table, default_lease_s=LEASE)
        self.region = bytearray(PAGE * SLOTS)
        self.terms = SourceTerms(INCARNATION, {"kv": PAGE}, ((0, len(self.region)),), can_move=can_move)

    def store(self, keys, announces, fill: int) -> None:
        pages = self.pool.begin_fill(keys, announces)
        for i, page in enumerate(pages):
            self.region[page.slot * PAGE:(page.slot + 1) * PAGE] = bytes([fill + i]) * PAGE
        self.pool.commit_fill(pages)

    def answer_claim(self, keys, *, owner: str, now: float) -> m.Granted:
        claim = self.claims.claim(self.pool, keys, owner=owner, lease_s=None, now=now)
        return replace(self.claims.granted(claim, [p.slot * PAGE for p in claim.pages]), incarnation=INCARNATION)

    def answer_release(self, action: SendRelease, *, owner: str):
        released = self.claims.release(action.claim_id, owner=owner, drop=action.drop)
        self.pool.remove(released.moved)  # move mode: what the puller verifiably received goes
        return released


def chain(n: int, start: int = 0):
    tokens = list(range(start, start + n * BLOCK))
    return request_page_hashes(tokens, BLOCK), announce_request(tokens, BLOCK)


def transfer(source: Source, action: Transfer, dest: bytearray) -> list[bool]:
    """The GETs, performed: destination addresses are offsets into `dest`, remote ones into the region."""
    for op in action.ops:
        dest[op.local:op.local + op.nbytes] = source.region[op.remote_offset:op.remote_offset + op.nbytes]
    return [True] * len(action.ops)


def claimed(source: Source, pull: Pull, keys, now: float) -> list:
    return pull.granted(source.answer_claim(keys, owner="dest", now=now), now)


@pytest.fixture
def source():
    return Source()


def test_a_claim_exchanged_end_to_end_delivers_its_pages_and_leaves_nothing_pinned(source):
    keys, ann = chain(4)
    source.store(keys[:3], ann[:3], fill=1)
    pull = Pull(PullTerms("kv", asked=4), source.terms, sent=0.0)
    assert claimed(source, pull, keys, now=0.0) == [] and pull.state is PullState.HELD and pull.num_pages == 3
    assert source.pool.num_claimed == 3
    dest = bytearray(4 * PAGE)
    (move,) = pull.plan([[i * PAGE] for i in range(4)], [PAGE])
    actions = pull.moved(transfer(source, move, dest), now=0.1)
    release = next(a for a in actions if isinstance(a, SendRelease))
    assert not release.wait  # inside the lease: the claimed bytes were read
    assert isinstance(actions[-1], Finish) and actions[-1].result.delivered == 3
    assert dest[:3 * PAGE] == b"".join(bytes([1 + i]) * PAGE for i in range(3))
    assert source.answer_release(release, owner="dest").reply.live == [True] * 3
    assert source.pool.num_claimed == 0 and source.table.statistics().num_claims == 0


def test_a_lease_that_ends_mid_transfer_delivers_only_the_pages_whose_slots_kept_their_bytes(source):
    keys, ann = chain(3)
    source.store(keys, ann, fill=1)
    pull = Pull(PullTerms("kv", asked=3), source.terms, sent=0.0)
    claimed(source, pull, keys, now=0.0)
    # The lease runs out at the source, which then drops the last page and stores another in its slot.
    assert source.claims.expire(now=LEASE + 1) == [pull.claim_id]
    source.pool.remove(keys[2:])
    other, other_ann = chain(1, start=1000)
    source.store(other, other_ann, fill=9)
    dest = bytearray(3 * PAGE)
    (move,) = pull.plan([[i * PAGE] for i in range(3)], [PAGE])
    actions = pull.moved(transfer(source, move, dest), now=LEASE + 1.5)
    (release,) = actions
    assert release.wait and pull.state is PullState.RELEASING  # late: only the source knows what stayed
    answer = source.answer_release(release, owner="dest")
    assert answer.expired and answer.reply.live == [True, True, False]
    (finish,) = pull.release_answered(answer.reply.live)
    assert finish.result.delivered == 2


def test_in_move_mode_the_source_drops_exactly_the_pages_the_destination_received():
    source = Source(can_move=True)
    keys, ann = chain(3)
    source.store(keys, ann, fill=1)
    pull = Pull(PullTerms("kv", asked=3), source.terms, sent=0.0)
    claimed(source, pull, keys, now=0.0)
    dest = bytearray(2 * PAGE)
    (move,) = pull.plan([[0], [PAGE]], [PAGE], move=True)  # room for two: the third stays claimed, not sent
    (release,) = pull.moved(transfer(source, move, dest), now=0.1)
    assert release.drop == 2 and release.wait
    source.answer_release(release, owner="dest")
    (finish,) = pull.release_answered([True] * 3)
    assert finish.result.delivered == 2
    assert source.pool.leading_ready(keys) == 0 and source.pool.leading_ready(keys[2:]) == 1


@pytest.mark.parametrize("how", ["the destination gave up waiting", "the destination cancelled it"])
def test_a_claim_the_destination_will_not_use_goes_back_at_once(source, how):
    keys, ann = chain(2)
    source.store(keys, ann, fill=1)
    pull = Pull(PullTerms("kv", asked=2), source.terms, sent=0.0)
    if how == "the destination gave up waiting":
        actions = pull.claim_timed_out(now=5.0)
        assert isinstance(actions[0], BackOff)
        release = late_grant_release(source.answer_claim(keys, owner="dest", now=5.5))  # it answers late
    else:
        claimed(source, pull, keys, now=0.0)
        (release,) = pull.cancel(wait=False)
    assert source.pool.num_claimed == 2
    source.answer_release(release, owner="dest")
    assert source.pool.num_claimed == 0 and source.table.statistics().num_claims == 0


def test_a_grant_from_a_restarted_source_is_given_back_and_claimed_again(source):
    keys, ann = chain(1)
    source.store(keys, ann, fill=1)
    pull = Pull(PullTerms("kv", asked=1), replace(source.terms, incarnation="before-restart"), sent=0.0)
    release, again = claimed(source, pull, keys, now=0.0)
    assert again.reason.startswith("the source restarted")
    source.answer_release(release, owner="dest")
    assert source.pool.num_claimed == 0
