"""The test hosts' packet delay schedule (tests/nfqueue.py), without the kernel: which packets are
due when, and which ones the others overtake."""

import pytest

from tests.nfqueue import DelayQueue

pytestmark = pytest.mark.pure


def test_without_reordering_packets_leave_in_order_one_delay_after_they_came():
    q = DelayQueue(delay_s=0.030, reorder_percent=0, reorder_s=0.010)
    for i, now in enumerate((0.000, 0.001, 0.002)):
        q.queue(100 + i, now)
    assert q.due(0.0305) == [100]
    assert q.due(0.0315) == [101] and q.next_due() == pytest.approx(0.032)
    assert q.due(1.0) == [102]
    assert (q.stats.queued, q.stats.released, q.stats.overtaken) == (3, 3, 0)


def test_a_held_back_packet_is_overtaken_by_the_ones_behind_it():
    q = DelayQueue(delay_s=0.030, reorder_percent=50, reorder_s=0.010)
    q.queue(2, 0.000)
    q.queue(1, 0.001)  # every second packet is held back: due at 0.041
    q.queue(3, 0.002)
    assert q.due(0.035) == [2, 3]
    assert q.due(0.0405) == [] and q.due(0.045) == [1]
    assert (q.stats.held_back, q.stats.overtaken) == (1, 1)


@pytest.mark.parametrize("percent, held", [(25, [3, 7, 11]), (50, [1, 3, 5, 7, 9, 11])])
def test_the_reorder_percent_of_packets_is_held_back_evenly(percent, held):
    q = DelayQueue(delay_s=0.0, reorder_percent=percent, reorder_s=0.010)
    for i in range(12):
        q.queue(i, 0.0)
    assert q.due(0.0) == [i for i in range(12) if i not in held]
    assert q.due(0.010) == held and q.stats.held_back == len(held)
