"""Live test 4, SGLang's `timeout` prefetch policy: a hinted peer that stops answering while B's
claim waits on it makes SGLang end B's prefetch on its own deadline (kvcr would have waited 30 s),
B answers as the peer would have, and the grant the peer sends once it resumes goes back at once."""

from __future__ import annotations

import signal

import pytest

from kvcr.proto.hints import build_envelope
from sglang_adapter.cpu_harness.model import prompt_text
from tests.helpers import wait_until
from tests.sglang_live.helpers import metric

pytestmark = pytest.mark.live_sglang
# SGLang's deadline: 0.5 s + 0.05 s per 1024 tokens; kvcr's own wait for a claim is far longer.
TIMEOUT = ["--hicache-storage-prefetch-policy", "timeout"]
SGLANG_DEADLINE = {"prefetch_timeout_base": 0.5, "prefetch_timeout_per_ki_token": 0.05}
PULLER = {"runner.control_timeout_s": 30.0}


@pytest.fixture(scope="module")
def pair(engines):
    (a,) = engines("timeout-A", args=["--hicache-storage-prefetch-policy", "wait_complete"])
    (b,) = engines("timeout-B", args=TIMEOUT, runner=PULLER, extra_config={**SGLANG_DEADLINE, "claim_lease_s": 60.0})
    return a, b


def runner_metric(server, name: str) -> float:
    return metric(server.runner_get("/metrics"), name)


def test_sglang_ends_a_prefetch_stuck_on_a_silent_peer_and_the_late_grant_goes_back(pair, live):
    a, b = pair
    text = prompt_text(700, 300)
    at_a = live.serve(a, text)
    envelope = build_envelope(a.endpoints["control"], a.stored_hashes())
    hits = runner_metric(a, "kvcr_hits_total")
    sched = live.scheduler(a)
    sched.send_signal(signal.SIGSTOP)
    try:
        got = live.generate(b, text, kv_hints=envelope)
        # answered while A is still stopped and before kvcr gave up on it: SGLang's deadline ended it
        assert runner_metric(b, "kvcr_peer_unreachable_total") == 0
    finally:
        sched.send_signal(signal.SIGCONT)
    assert got["meta_info"]["cached_tokens"] == 0
    assert got["output_ids"] == at_a["output_ids"]
    assert live.logprobs(got) == live.logprobs(at_a)
    wait_until(lambda: runner_metric(a, "kvcr_hits_total") > hits and runner_metric(a, "kvcr_claims_held") == 0,
               timeout_s=20, interval_s=0.2, message="A's late grant released well within its 60 s lease")
    # B's prefetch thread is free again: the same hint now pulls
    live.flush(b)
    again = live.generate(b, text, kv_hints=envelope)
    assert again["meta_info"]["cached_tokens_details"]["storage"] == at_a["meta_info"]["prompt_tokens"] // 16 * 16
    assert live.logprobs(again) == live.logprobs(at_a)
