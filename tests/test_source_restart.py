"""A source SIGKILLed and restarted on the same control endpoint is pulled from again within a
second of answering (docs/reliability.md), whatever the transport and however busy the host: the
puller's back-off skips it only until a background probe hears it."""

import threading
import time

import pytest

from kvcr.client import ControlClient
from kvcr.proto import messages as m
from tests.peers import PAGE, POOLS, buffers, no_claims_left, source, store, wait_registered

RECOVERY_S = 1.0  # the promise: every pull starting this long after the first answer succeeds


def first_answer(endpoint: str, stop: threading.Event, seen: list[float]) -> None:
    """Records when `endpoint` first answers an info request (asked every ~20 ms)."""
    with ControlClient(endpoint, timeout_s=0.02, local=False) as client:
        while not stop.is_set():
            try:
                client.request(m.InfoRequest())
            except TimeoutError:
                continue
            seen.append(time.monotonic())
            return


@pytest.mark.parametrize("transport", ["get", "tag", "shm"])
def test_a_restarted_source_is_pulled_from_within_a_second_of_answering(runner_factory, puller, transport, cpu_hog):
    puller.transport = transport
    a, ai = source(runner_factory)
    endpoint = ai["endpoints"]["control"]
    keys, _, data = store(ai, 4, seed=40)
    raw, dests = buffers(4)
    assert puller.pull(endpoint, "kv", keys, dests).delivered == 4
    a.proc.kill()
    a.proc.wait(10)
    assert puller.pull(endpoint, "kv", keys, dests).delivered == 0  # gone: a miss, and its back-off starts
    assert puller.reach.is_down(endpoint, time.monotonic())

    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=first_answer, args=(endpoint, stop, seen), daemon=True)
    watcher.start()
    b = runner_factory("a2", **{"dram.pools": POOLS, "runner.control_endpoint": endpoint})
    bi = b.start()
    watcher.join(30)
    stop.set()
    assert seen, "the restarted source never answered"
    wait_registered(bi)
    keys2, _, data2 = store(bi, 4, seed=41)
    time.sleep(max(0.0, seen[0] + RECOVERY_S - time.monotonic()))
    for attempt in range(3):
        raw, dests = buffers(4)
        result = puller.pull(endpoint, "kv", keys2, dests)
        assert result.delivered == 4, (attempt, result.error, puller.reach.num_skipped)
        assert raw.raw[:4 * PAGE] == b"".join(data2)
    assert puller.reach.num_recovered == 1  # the probe ended it, not the 5 s back-off
    no_claims_left(bi)
