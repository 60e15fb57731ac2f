"""A worker whose requests fail leaves the routing until its health check passes (pure)."""

import pytest

from router_hints.breaker import Breakers

pytestmark = pytest.mark.pure

A, B = ("a", 0), ("b", 0)


def test_a_refused_connection_opens_the_breaker_at_once():
    breakers = Breakers(failures_to_open=3)
    assert breakers.failed(A, refused=True) and breakers.is_open(A) and breakers.open == {A}
    assert not breakers.is_open(B) and breakers.num_opened == 1
    assert not breakers.failed(A, refused=True) and breakers.num_opened == 1  # already open


@pytest.mark.parametrize("failures_to_open", [1, 2, 3])
def test_other_failures_open_it_after_so_many_in_a_row(failures_to_open):
    breakers = Breakers(failures_to_open=failures_to_open)
    opened = [breakers.failed(A, refused=False) for _ in range(failures_to_open)]
    assert opened == [False] * (failures_to_open - 1) + [True]


def test_a_success_between_failures_resets_the_count():
    breakers = Breakers(failures_to_open=2)
    breakers.failed(A, refused=False)
    breakers.succeeded(A)
    assert not breakers.failed(A, refused=False) and not breakers.is_open(A)


def test_a_passed_health_check_closes_it_and_the_count_starts_afresh():
    breakers = Breakers(failures_to_open=2)
    breakers.failed(A, refused=True)
    assert breakers.health_passed(A) and not breakers.is_open(A)
    assert not breakers.health_passed(A)  # it was not open
    assert not breakers.failed(A, refused=False)  # one of two again
