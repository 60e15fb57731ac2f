"""A source that does not answer is skipped for a back-off that doubles and ends with an answer."""

import pytest

from kvcr.proto.reach import MAX_BACKOFF_FACTOR, Reachability

pytestmark = pytest.mark.pure


def test_an_unanswered_source_is_skipped_until_its_backoff_ends():
    reach = Reachability(backoff_s=5.0)
    assert reach.allow("tcp://a", now=0.0)
    assert reach.failed("tcp://a", now=0.0) == 5.0
    assert not reach.allow("tcp://a", now=4.9) and reach.num_skipped == 1
    assert reach.allow("tcp://b", now=1.0)  # other sources are not affected
    assert reach.allow("tcp://a", now=5.0)


@pytest.mark.parametrize("failures, wait", [(1, 5.0), (2, 10.0), (3, 20.0), (10, 5.0 * MAX_BACKOFF_FACTOR)])
def test_the_backoff_doubles_per_failure_up_to_its_ceiling(failures, wait):
    reach = Reachability(backoff_s=5.0)
    for _ in range(failures):
        until = reach.failed("tcp://a", now=100.0)
    assert until == 100.0 + wait and reach.num_failures == failures


def test_an_answer_ends_the_backoff():
    reach = Reachability(backoff_s=5.0)
    reach.failed("tcp://a", now=0.0)
    reach.failed("tcp://a", now=0.0)
    reach.answered("tcp://a")
    assert reach.allow("tcp://a", now=0.1) and not reach.is_down("tcp://a", now=0.1)
    assert reach.failed("tcp://a", now=1.0) == 6.0  # counted from one again


def test_a_down_source_is_probed_every_interval_while_its_backoff_runs():
    reach = Reachability(backoff_s=5.0, probe_s=0.25)
    assert reach.probes_due(now=0.0) == [] and reach.next_probe_at(now=0.0) is None
    reach.failed("tcp://a", now=0.0)
    assert reach.next_probe_at(now=0.0) == 0.25
    assert reach.probes_due(now=0.2) == []
    assert reach.probes_due(now=0.25) == ["tcp://a"]
    assert reach.probes_due(now=0.3) == []  # one probe per interval
    assert reach.probes_due(now=0.5) == ["tcp://a"]
    assert reach.probes_due(now=5.0) == [] and reach.next_probe_at(now=5.0) is None  # back-off over: requests ask it


def test_a_probes_answer_ends_the_backoff_and_is_counted_once():
    reach = Reachability(backoff_s=5.0, probe_s=0.25)
    reach.failed("tcp://a", now=0.0)
    assert reach.probe_answered("tcp://a") and reach.num_recovered == 1
    assert reach.allow("tcp://a", now=0.3) and reach.probes_due(now=1.0) == []
    assert not reach.probe_answered("tcp://a") and reach.num_recovered == 1  # it was not down


def test_no_probes_when_they_are_turned_off():
    reach = Reachability(backoff_s=5.0, probe_s=0.0)
    reach.failed("tcp://a", now=0.0)
    assert reach.probes_due(now=1.0) == [] and reach.next_probe_at(now=1.0) is None
    assert not reach.allow("tcp://a", now=4.0)
