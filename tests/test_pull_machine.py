"""The pull's state machine, fed messages and `now`: no sockets, no processes, no UCX."""

import pytest

from kvcr.proto import messages as m
from kvcr.proto.pull import (MISS, BackOff, ClaimAgain, CopyInline, DigestMismatch, Finish, ForgetSource, Pull,
                             PullResult,
                             PullState, PullStateError, PullTerms, Refuse, SendRelease, SourceTerms, Transfer,
                             choose_transport, late_grant_release, pages_inside)

pytestmark = pytest.mark.pure

PAGE = 4096
INCARNATION = "src-1"
LEASE = 10.0


def grant(offsets=(0, PAGE, 2 * PAGE, 3 * PAGE), *, claim_id=7, lease_s=LEASE, incarnation=INCARNATION,
          digests=(), data=b""):
    return m.Granted(claim_id=claim_id, offsets=list(offsets), lease_s=lease_s, incarnation=incarnation,
                     digests=list(digests), data=data)


INLINE = bytes(range(256)) * (4 * PAGE // 256)  # four pages' bytes, as a source answers a small claim


@pytest.fixture
def make_pull():
    def make(*, asked=4, digests=False, retried=False, can_move=False, chunks=((0, 64 * PAGE),), lease_s=0.0,
             page_bytes=PAGE):
        source = SourceTerms(INCARNATION, {"kv": PAGE}, tuple(chunks), can_move)
        return Pull(PullTerms("kv", asked, page_bytes, digests, lease_s, retried), source, sent=100.0)
    return make


@pytest.fixture
def held(make_pull):
    """A pull whose claim on 4 pages was granted at t=100 with a 10 s lease."""
    def make(**kw):
        pull = make_pull(**kw)
        assert pull.granted(grant(digests=(11, 12, 13, 14) if kw.get("digests") else ()), 100.01) == []
        assert pull.state is PullState.HELD
        return pull
    return make


def destinations(n=4):
    return [(0x10000 + i * PAGE,) for i in range(n)]


def moving(pull, n=4, **kw):
    [transfer] = pull.plan(destinations(n), (PAGE,), **kw)
    assert isinstance(transfer, Transfer) and pull.state is PullState.MOVING
    return transfer


def test_a_transfer_inside_the_lease_is_released_without_waiting_and_delivers_every_page(held):
    pull = held()
    transfer = moving(pull)
    assert len(transfer.ops) == 1 and transfer.ops[0].nbytes == 4 * PAGE  # adjacent pages: one GET
    actions = pull.moved((True,), 101.0)
    assert actions == [SendRelease(7, 0, wait=False), Finish(PullResult(4))]
    assert pull.state is PullState.DONE and pull.released


def test_a_transfer_that_ends_late_asks_the_source_which_slots_stayed_live(held):
    pull = held()
    moving(pull)
    assert pull.moved((True,), 108.5) == [SendRelease(7, 0, wait=True)]  # past the lease margin
    assert pull.state is PullState.RELEASING
    assert pull.release_answered((True, True, False, True)) == [Finish(PullResult(2))]


def test_a_late_transfer_whose_release_goes_unanswered_delivers_nothing(held):
    pull = held()
    moving(pull)
    pull.moved((True,), 109.9)
    assert pull.release_answered(()) == [Finish(PullResult(0))]


def test_only_the_leading_pages_whose_bytes_arrived_are_delivered(held):
    pull = held(chunks=((0, 2 * PAGE), (2 * PAGE, 62 * PAGE)))  # two chunks: two GETs
    transfer = moving(pull)
    assert [op.pages for op in transfer.ops] == [(0, 1), (2, 3)]
    *_, finish = pull.moved((True, False), 101.0, error="peer gone")
    assert finish == Finish(PullResult(2, error="peer gone"))


def test_a_failed_transfer_forgets_the_source_so_the_next_pull_reconnects(held):
    pull = held()
    moving(pull)
    actions = pull.moved((False,), 101.0, error="endpoint closed")
    assert ForgetSource("endpoint closed") in actions and actions[-1] == Finish(PullResult(0, error="endpoint closed"))


def test_a_transfer_that_raised_is_uncertain_and_still_gives_the_claim_back(held):
    pull = held()
    moving(pull)
    assert pull.move_failed("RuntimeError: boom") == [SendRelease(7), Finish(PullResult(0, True, "RuntimeError: boom"))]
    assert pull.cancel() == []  # released once, whatever the caller does next


def test_move_mode_drops_only_the_pages_verifiably_received_and_waits_for_the_answer(held):
    pull = held(can_move=True, chunks=((0, 3 * PAGE), (3 * PAGE, 61 * PAGE)))
    moving(pull, move=True)
    assert pull.moved((True, False), 101.0) == [SendRelease(7, 3, wait=True)]
    assert pull.release_answered((True,) * 4) == [Finish(PullResult(3))]


def test_move_mode_towards_a_source_that_cannot_move_keeps_its_copies(held):
    pull = held(can_move=False)
    moving(pull, move=True)
    assert pull.moved((True,), 101.0)[0] == SendRelease(7, 0, wait=False)


def test_an_uncertain_transfer_never_drops_the_source_copy(held):
    pull = held(can_move=True)
    moving(pull, move=True)
    assert pull.moved((True,), 101.0, uncertain=True)[0] == SendRelease(7, 0, wait=False)


@pytest.mark.parametrize("received, delivered, mismatch", [
    ((11, 12, 13, 14), 4, None),
    ((11, 12, 99, 14), 2, 2),
    ((0, 12, 13, 14), 0, 0),
])
def test_with_digests_delivery_stops_at_the_first_page_that_differs(held, received, delivered, mismatch):
    pull = held(digests=True)
    assert moving(pull).digests
    actions = pull.moved((True,), 101.0, digests=received)
    assert (DigestMismatch(mismatch) in actions) == (mismatch is not None)
    assert actions[-1] == Finish(PullResult(delivered))


@pytest.mark.parametrize("kw", [dict(slice_offset=PAGE // 2), dict(slice_offset=-1), dict(move=True)])
def test_pieces_that_do_not_fit_a_whole_page_are_refused_and_the_claim_given_back(held, kw):
    pull = held(digests=True, can_move=True)
    segments = (PAGE // 2,) if "move" in kw else (PAGE // 2 + 1,)
    actions = pull.plan(destinations(), segments, **kw)
    assert actions[0] == SendRelease(7) and isinstance(actions[1], Refuse) and pull.state is PullState.DONE


def test_a_slice_of_each_page_is_planned_from_its_offset(held):
    pull = held()
    [transfer] = pull.plan(destinations(2), (PAGE // 4,), slice_offset=PAGE // 2)
    assert [(op.remote_offset, op.nbytes) for op in transfer.ops] == [(PAGE // 2, PAGE // 4),
                                                                       (PAGE + PAGE // 2, PAGE // 4)]


def test_a_grant_from_a_restarted_source_is_given_back_and_claimed_again_once(make_pull):
    pull = make_pull()
    actions = pull.granted(grant(incarnation="src-2"), 100.01)
    assert actions[0] == SendRelease(7) and isinstance(actions[1], ClaimAgain)
    again = make_pull(retried=True)
    release, forget, miss = again.granted(grant(incarnation="src-3"), 100.02)
    assert (release, miss) == (SendRelease(7), MISS) and isinstance(forget, ForgetSource)


def test_a_grant_outside_the_memory_we_know_of_is_claimed_again_after_a_fresh_look(make_pull):
    pull = make_pull(chunks=((0, 2 * PAGE),))
    assert isinstance(pull.granted(grant(), 100.01)[-1], ClaimAgain)


@pytest.mark.parametrize("offsets, inside", [
    ((), True),
    ((PAGE, 0), True),                           # one chunk holds their whole span
    ((0, 3 * PAGE, PAGE), True),                 # each lies in one chunk or the other
    ((PAGE + PAGE // 2,), False),                # across the two chunks' boundary
    ((0, 4 * PAGE), False),                      # past the last chunk
])
def test_pages_are_inside_only_when_each_lies_whole_in_one_chunk(offsets, inside):
    assert pages_inside(offsets, PAGE, ((0, 2 * PAGE), (2 * PAGE, 2 * PAGE))) is inside


@pytest.mark.parametrize("reply, problem", [
    (grant(offsets=(0, PAGE, 2 * PAGE, 3 * PAGE, 4 * PAGE)), "one non-negative integer per page"),
    (grant(offsets=(0, -PAGE)), "one non-negative integer per page"),
    (grant(lease_s=0.0), "not a duration"),
    (grant(lease_s=1e9), "not a duration"),
])
def test_a_grant_that_makes_no_sense_is_given_back_and_counts_as_a_miss(make_pull, reply, problem):
    release, finish = make_pull().granted(reply, 100.01)
    assert release == SendRelease(7) and finish.result.delivered == 0 and problem in finish.result.error


def test_a_source_whose_pages_are_another_size_gets_its_claim_back(make_pull):
    release, finish = make_pull(page_bytes=2 * PAGE).granted(grant(), 100.01)
    assert release == SendRelease(7) and "bytes there" in finish.result.error


def test_digests_asked_for_but_missing_are_refused(make_pull):
    _, finish = make_pull(digests=True).granted(grant(digests=(1, 2)), 100.01)
    assert "digests were asked for" in finish.result.error


def test_an_empty_grant_is_a_miss_with_nothing_to_release(make_pull):
    pull = make_pull()
    assert pull.granted(grant(offsets=()), 100.01) == [MISS] and pull.cancel() == []


def test_a_claim_that_times_out_backs_off_until_a_late_grant_cannot_come(make_pull):
    assert make_pull().claim_timed_out(102.0) == [BackOff(132.0), MISS]  # the default lease wait
    assert make_pull(lease_s=5.0).claim_timed_out(102.0) == [BackOff(107.0), MISS]


@pytest.mark.parametrize("code, refuse", [("namespace", True), ("busy", False), ("claim_limit", False),
                                         ("bad_reply", False)])
def test_only_a_namespace_refusal_makes_the_source_unusable(make_pull, code, refuse):
    [action] = make_pull().claim_refused(code, f"{code}: no")
    assert isinstance(action, Refuse) == refuse
    assert refuse or action == Finish(PullResult(0, error=f"{code}: no"))


def test_a_grant_that_arrives_after_we_gave_up_is_released_at_once():
    assert late_grant_release(grant()) == SendRelease(7, wait=False)
    assert late_grant_release(grant(offsets=())) is None
    assert late_grant_release(grant(data=INLINE)) is None  # the source ended it as it answered
    assert late_grant_release(m.Released(live=[True])) is None


def test_the_lease_is_over_at_the_deadline_taken_from_when_the_claim_was_sent(held):
    pull = held()
    assert pull.deadline == 100.0 + LEASE
    assert not pull.lease_over(109.99) and pull.lease_over(110.0)


@pytest.mark.parametrize("event", ["plan", "moved", "release_answered"])
def test_an_event_out_of_order_is_a_driver_bug_named_as_such(make_pull, event):
    pull = make_pull()
    call = {"plan": lambda: pull.plan(destinations(), (PAGE,)), "moved": lambda: pull.moved((True,), 101.0),
            "release_answered": lambda: pull.release_answered(())}[event]
    with pytest.raises(PullStateError, match=event):
        call()


def test_cancel_gives_the_claim_back_once_and_ends_the_pull(held):
    pull = held()
    assert pull.cancel(wait=False) == [SendRelease(7, wait=False)]
    assert pull.cancel() == [] and pull.state is PullState.DONE
    with pytest.raises(PullStateError):
        pull.plan(destinations(), (PAGE,))


@pytest.mark.parametrize("requested, same_host, chosen", [
    ("auto", True, "shm"), ("auto", False, "get"), ("get", True, "get"), ("tag", True, "tag"), ("shm", False, "shm"),
])
def test_auto_copies_on_the_same_host_and_asks_the_host_only_then(requested, same_host, chosen):
    asked = []
    assert choose_transport(requested, lambda: asked.append(1) or same_host) == chosen
    assert bool(asked) == (requested == "auto")


# --- small claims answered with their bytes -------------------------------------------------------

def inline_pull(make_pull, **kw):
    pull = make_pull(**kw)
    assert pull.granted(grant(data=INLINE, digests=(11, 12, 13, 14) if kw.get("digests") else ()), 100.01) == []
    assert pull.state is PullState.HELD and pull.released  # the source ended the claim when it answered
    return pull


def test_a_grant_with_the_bytes_inline_plans_a_copy_out_of_them_and_releases_nothing(make_pull):
    pull = inline_pull(make_pull)
    dests = [(0x10000 + i * PAGE // 2, 0x90000 + i * PAGE // 2) for i in range(4)]  # K and V halves
    [copy] = pull.plan(dests, (PAGE // 2, PAGE // 2))
    assert isinstance(copy, CopyInline) and copy.data is INLINE
    assert [(op.local, op.nbytes, op.remote_offset) for op in copy.ops][:2] == \
        [(0x10000, PAGE // 2, 0), (0x90000, PAGE // 2, PAGE // 2)]
    # Copied long after the lease: the bytes were read under the claim, so every page counts.
    assert pull.moved((True,) * len(copy.ops), 500.0) == [Finish(PullResult(4))]
    assert pull.cancel() == []


def test_inline_bytes_are_checked_against_the_sources_digests(make_pull):
    pull = inline_pull(make_pull, digests=True)
    [copy] = pull.plan(destinations(), (PAGE,))
    assert copy.digests
    assert pull.moved((True,) * len(copy.ops), 100.5, digests=(11, 12, 99, 14)) == \
        [DigestMismatch(2), Finish(PullResult(2))]


@pytest.mark.parametrize("data, problem", [
    (INLINE[:-1], "inline bytes are not 4 pages"),
    (INLINE + b"x", "inline bytes are not 4 pages"),
])
def test_inline_bytes_that_are_not_the_granted_pages_are_refused_with_nothing_to_release(make_pull, data, problem):
    pull = make_pull()
    [finish] = pull.granted(grant(data=data), 100.01)
    assert isinstance(finish, Finish) and finish.result.delivered == 0 and problem in finish.result.error
    assert pull.state is PullState.DONE


def test_a_move_of_inline_bytes_asks_the_source_to_drop_nothing(make_pull):
    pull = inline_pull(make_pull, can_move=True)
    [copy] = pull.plan(destinations(), (PAGE,), move=True)
    assert pull.moved((True,) * len(copy.ops), 100.5) == [Finish(PullResult(4))]
