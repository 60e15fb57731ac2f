"""Live test 4: faults around a live engine's peer pulls. A hint naming a dead, stalled, killed
or foreign peer is a miss (the engine recomputes and answers as the peer would have), never an
error; a malformed hint is ignored with a log line; the source keeps no claim; a restarted
source serves the same puller again; an engine's shutdown leaves no shared-memory region."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvcr.proto.hints import build_envelope
from sglang_adapter.cpu_harness.model import prompt_text
from sglang_adapter.cpu_harness.server import free_port
from tests.helpers import wait_until
from tests.sglang_live.helpers import metric

pytestmark = pytest.mark.live_sglang
PAGE = 16
WAIT = ["--hicache-storage-prefetch-policy", "wait_complete"]
# B asks a silent peer for 1 s, then leaves it alone for 5 s (doubling): counted, not timed.
PULLER = {"runner.control_timeout_s": 1.0, "runner.unreachable_backoff_s": 5.0}


def served(server, live, seed: int, words: int = 300) -> tuple[str, dict]:
    """A prompt the engine served and backed up whole; returns it and the answer."""
    text = prompt_text(seed, words)
    return text, live.serve(server, text)


def runner_metric(server, name: str) -> float:
    return metric(server.runner_get("/metrics"), name)


def regions(server) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"kvcr-{server.name}-")}


@pytest.fixture(scope="module")
def trio(engines):
    a, b = engines("fault-A", "fault-B", args=WAIT, each={"fault-B": PULLER},
                   extra_config={"claim_lease_s": 60.0})
    (c,) = engines("fault-C", args=[*WAIT, "--hicache-mem-layout", "page_first_direct"])
    return a, b, c


def test_a_hint_naming_a_dead_peer_is_a_miss_and_the_peer_is_asked_once(trio, live):
    a, b, _ = trio
    own_text, _ = served(b, live, seed=200)
    live.flush(b)
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    answers = []
    for seed in (201, 202):
        text, at_a = served(a, live, seed=seed)
        got = live.generate(b, text, kv_hints=build_envelope(dead, a.stored_hashes()))
        assert got["meta_info"]["cached_tokens"] == 0
        assert live.logprobs(got) == live.logprobs(at_a)
        answers.append(got)
    assert runner_metric(b, "kvcr_peer_unreachable_total") == 1       # the first hint waited once
    assert runner_metric(b, "kvcr_peer_skipped_unreachable_total") >= 1  # the second did not wait
    own = live.generate(b, own_text)  # B's own pages were never blocked behind the dead source
    assert own["meta_info"]["cached_tokens_details"]["storage"] > 0


def test_a_hint_naming_a_peer_of_another_namespace_is_a_miss(trio, live):
    _, b, c = trio
    text, at_c = served(c, live, seed=210)
    got = live.generate(b, text, kv_hints=build_envelope(c.endpoints["control"], c.stored_hashes()))
    assert got["meta_info"]["cached_tokens"] == 0
    assert live.logprobs(got) == live.logprobs(at_c)
    assert runner_metric(c, "kvcr_claims_held") == 0
    assert "layout" in b.tail(20000) and "page_first_direct" in b.tail(20000)


@pytest.mark.parametrize("hint", ["not an envelope", {"protocol_version": "0.1", "actions": "x"},
                                  {"actions": [{"action_type": "kv.fetch", "payload": {"block_hashes": [-1]}}]}])
def test_a_malformed_hint_is_ignored_and_the_engine_keeps_serving(trio, live, hint):
    _, b, _ = trio
    text = prompt_text(220, 200)
    try:
        got = live.generate(b, text, kv_hints=hint)
        assert got["meta_info"]["cached_tokens"] == 0 or got["meta_info"]["cached_tokens_details"]["storage"] == 0
    except Exception as exc:  # noqa: BLE001 - an HTTP 4xx naming the field is a fine answer too
        assert "400" in str(exc) or "422" in str(exc), exc
    assert b.proc.poll() is None
    plain = live.generate(b, prompt_text(221, 50))
    assert plain["meta_info"]["prompt_tokens"] > 0


def test_a_hit_below_the_prefetch_threshold_is_revoked_and_its_claim_given_back_at_once(trio, live):
    a, b, _ = trio  # B asks a 60 s lease
    live.revoked_claim_comes_back(a, b, seed=250)


def test_a_peer_killed_while_the_prefetch_waits_on_it_is_a_miss_and_serves_again_after_restart(trio, live):
    a, b, _ = trio
    text, at_a = served(a, live, seed=230)
    envelope = build_envelope(a.endpoints["control"], a.stored_hashes())
    old_regions = regions(a)
    live.scheduler(a).send_signal(signal.SIGSTOP)  # the claim below waits on A
    result: dict = {}
    asking = threading.Thread(target=lambda: result.update(live.generate(b, text, kv_hints=envelope)))
    asking.start()
    time.sleep(0.3)
    a.stop(signal.SIGKILL)
    asking.join(120)
    assert result and result["meta_info"]["cached_tokens"] == 0
    assert live.logprobs(result) == live.logprobs(at_a)
    assert b.proc.poll() is None
    a.start().wait_ready()
    live.pulls_again(a, b, prompt_text(231, 300))
    assert not (old_regions & regions(a)), "the killed engine's region outlived its restart"


def test_a_stalled_peers_late_grant_is_given_back_at_once(trio, live):
    a, b, _ = trio
    text, at_a = served(a, live, seed=240)
    envelope = build_envelope(a.endpoints["control"], a.stored_hashes())
    hits = runner_metric(a, "kvcr_hits_total")
    sched = live.scheduler(a)
    sched.send_signal(signal.SIGSTOP)
    try:
        got = live.generate(b, text, kv_hints=envelope)  # B stops waiting after 1 s: a miss
    finally:
        sched.send_signal(signal.SIGCONT)
    assert got["meta_info"]["cached_tokens"] == 0
    assert live.logprobs(got) == live.logprobs(at_a)
    # A granted the claim once resumed (its pages counted as hits) and got it back long before
    # the 60 s lease B asked for
    wait_until(lambda: runner_metric(a, "kvcr_hits_total") > hits and runner_metric(a, "kvcr_claims_held") == 0,
               timeout_s=20, interval_s=0.2, message="A's late grant released")


def test_an_engines_shutdown_leaves_no_shared_memory_region(trio):
    a, _, _ = trio
    assert regions(a)
    assert a.stop(signal.SIGTERM) is not None
    assert not regions(a), f"left in /dev/shm: {regions(a)}"
