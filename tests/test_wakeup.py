"""The waker that lets another thread end a ZMQ poll (control replies, queued event batches)."""

import threading

import pytest
import zmq

from kvcr.drivers.wakeup import Waker

pytestmark = pytest.mark.pure


@pytest.fixture
def waker():
    w = Waker()
    yield w
    w.close()


def _ready(poller: zmq.Poller, fd: int, timeout_ms: int) -> bool:
    return fd in dict(poller.poll(timeout_ms))


@pytest.fixture
def poller(waker):
    p = zmq.Poller()
    p.register(waker.fd, zmq.POLLIN)
    return p


def test_a_wake_from_another_thread_ends_the_poll_and_clear_rearms_it(waker, poller):
    assert not _ready(poller, waker.fd, 0)
    threading.Thread(target=waker.wake).start()
    assert _ready(poller, waker.fd, 10_000)
    waker.clear()
    assert not _ready(poller, waker.fd, 0)


def test_many_wakes_before_a_poll_are_one_readiness(waker, poller):
    for _ in range(5):
        waker.wake()
    assert _ready(poller, waker.fd, 0)
    waker.clear()
    assert not _ready(poller, waker.fd, 0)


def test_clear_without_a_wake_and_a_wake_after_close_do_nothing(waker):
    waker.clear()
    waker.close()
    waker.wake()  # a publisher racing the runner's shutdown must not write to a reused fd
    waker.clear()
