"""The keeper behind the SGLang adapter's reads: jobs run in order on one thread, a fence waits
for what was queued before it, a failing job stops nothing, closing drains the queue."""

import threading

import pytest
import torch

from sglang_adapter.keeper import Keeper


def waits(fn, gate: threading.Event, before=lambda: True) -> bool:
    """Whether fn() waits for the gate (`before` holding meanwhile); with the gate open it returns."""
    t = threading.Thread(target=fn)
    t.start()
    t.join(0.3)
    blocked = t.is_alive() and before()
    if not blocked:
        t.join(10)  # a slow thread that is not waiting on the gate still ends with it shut
        blocked = t.is_alive()
    gate.set()
    t.join(10)
    assert not t.is_alive()
    return blocked


@pytest.fixture
def held_up():
    """A keeper whose thread waits on `gate`, with one more job queued behind: (keeper, gate, ran)."""
    keeper, ran, gate = Keeper(), [], threading.Event()
    keeper.submit(gate.wait)
    keeper.submit(lambda: ran.append(1))
    yield keeper, gate, ran
    gate.set()
    keeper.close()


def test_a_fence_returns_once_the_jobs_queued_before_it_ran(held_up):
    keeper, gate, ran = held_up
    assert waits(keeper.fence, gate, before=lambda: ran == [] and keeper.pending == 2)
    assert ran == [1] and keeper.pending == 0


def test_a_failing_job_is_logged_and_the_next_ones_still_run(caplog):
    keeper, ran = Keeper(), []
    keeper.submit(lambda: 1 / 0)
    keeper.submit(lambda: ran.append("after"))
    keeper.fence()
    assert ran == ["after"]
    assert "keeping pulled pages failed" in caplog.text
    keeper.close()


def test_closing_runs_what_is_queued_and_refuses_more(held_up):
    keeper, gate, ran = held_up
    assert waits(keeper.close, gate)
    assert ran == [1]
    with pytest.raises(RuntimeError, match="closed"):
        keeper.submit(lambda: None)


class Pool:
    """A host pool's allocator surface, counting calls."""

    def __init__(self):
        self.calls = []

    def alloc(self, n):
        self.calls.append(("alloc", n))
        return n

    def free(self, indices):
        self.calls.append(("free", list(indices)))
        return len(indices)

    def clear(self):
        self.calls.append(("clear",))


@pytest.mark.parametrize("call, blocks", [
    (lambda pool: pool.free(torch.tensor([6, 7])), True),    # a slot the queued keep reads
    (lambda pool: pool.free(torch.tensor([12, 13])), False),  # slots it does not
    (lambda pool: pool.clear(), True),
    (lambda pool: pool.alloc(8), False),                       # alloc hands out freed slots only
])
def test_a_guarded_pool_waits_for_the_keeps_reading_the_slots_it_lets_go(call, blocks):
    keeper, pool, gate = Keeper(), Pool(), threading.Event()
    keeper.guard(pool)
    keeper.guard(pool)
    assert not hasattr(pool.free.__wrapped__, "__wrapped__")  # one fence, not one per guard
    keeper.submit(gate.wait, reads=(pool, torch.arange(4, 8)))
    assert waits(lambda: call(pool), gate) is blocks
    assert len(pool.calls) == 1
    keeper.close()


def test_closing_gives_the_pool_its_own_methods_back():
    keeper, pool = Keeper(), Pool()
    free = pool.free
    keeper.guard(pool)
    assert pool.free != free
    keeper.close()
    assert pool.free == free and pool.free.__func__ is Pool.free


def die():
    raise SystemExit  # not an Exception: it ends the keeper's thread


def test_a_keeper_whose_thread_died_holds_no_free_back(monkeypatch):
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's death is the point
    keeper, pool = Keeper(), Pool()
    keeper.guard(pool)
    keeper.submit(die, reads=(pool, torch.arange(4)))
    keeper.fence()  # returns: the thread ended, and took nothing with it that a fence waits on
    pool.free(torch.tensor([1]))
    assert pool.calls == [("free", [1])]
    with pytest.raises(RuntimeError, match="closed"):
        keeper.submit(lambda: None)
    keeper.close()  # joins the dead thread while its exception hook is still ours
