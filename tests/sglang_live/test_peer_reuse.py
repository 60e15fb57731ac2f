"""Live test 2: engine B, given a `kv_hints` envelope naming engine A's pages, confirms and claims
them at A, pulls them (UCX GETs, the bytes in the claim's answer, or the same-host copy) into its
host pages, reports exactly the confirmed pages as cached, answers as A did, and keeps the pages in
its own runner."""

from __future__ import annotations

import pytest

from kvcr.client import ControlClient
from kvcr.proto import messages as m
from kvcr.proto.hints import build_envelope
from tests.helpers import wait_until
from tests.sglang_live.helpers import metric
from sglang_adapter.cpu_harness.model import prompt_text

pytestmark = pytest.mark.live_sglang
PAGE = 16
WAIT = ["--hicache-storage-prefetch-policy", "wait_complete"]


@pytest.fixture(scope="module")
def trio(engines):
    # "get" claims, GETs and releases; "inline" takes the bytes in the claim's answer (its limit
    # raised over the tiny model's prompt, which is a few hundred KiB); "shm" copies from A's pool.
    a, b_get, b_inline, b_shm = engines(
        "peer-A", "peer-B-get", "peer-B-inline", "peer-B-shm", args=WAIT,
        each={"peer-A": {"runner.inline_pull_bytes": "16Mi"},  # what it answers inline (B-get asks for none)
              "peer-B-get": {"runner.transfer": "get", "runner.inline_pull_bytes": 0},
              "peer-B-inline": {"runner.transfer": "get", "runner.inline_pull_bytes": "16Mi"},
              "peer-B-shm": {"runner.transfer": "shm"}})
    return a, {"get": b_get, "inline": b_inline, "shm": b_shm}


@pytest.mark.parametrize("transfer", ["get", "inline", "shm"])
def test_a_hinted_engine_pulls_the_peers_pages_and_answers_as_the_peer(trio, transfer, live):
    a, bs = trio
    b = bs[transfer]
    text = prompt_text(100, 500)  # the same prompt for each B: A serves it once, each B pulls it
    first = live.serve(a, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    hint = build_envelope(a.endpoints["control"], a.stored_hashes())
    pulled = live.generate(b, text, kv_hints=hint)
    meta = pulled["meta_info"]
    assert meta["cached_tokens"] == full * PAGE
    assert meta["cached_tokens_details"]["storage"] == full * PAGE
    assert pulled["output_ids"] == first["output_ids"]
    assert live.logprobs(pulled) == live.logprobs(first)
    wait_until(lambda: metric(a.runner_get("/metrics"), "kvcr_claims_held") == 0, timeout_s=10,
               message="A's claims released")
    b_metrics = b.runner_get("/metrics")
    assert metric(b_metrics, "kvcr_pulled_pages_total") >= full
    inline = metric(b_metrics, "kvcr_pulled_inline_pages_total")
    assert inline >= full if transfer == "inline" else inline == 0
    # B keeps what it pulled (just after the read), announced whole from the root: no hint needed next time
    wait_until(lambda: set(a.stored_hashes()) <= set(b.stored_hashes()), timeout_s=10,
               message="B kept the pulled pages")
    b_chain = b.stored()
    roots = [e for e in b_chain if e.parent_block_hash is None]
    assert roots and roots[0].block_hashes[0] == a.stored_hashes()[0]
    live.flush(b)
    again = live.generate(b, text)
    assert again["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert live.logprobs(again) == live.logprobs(first)


def test_a_hint_posted_to_the_engines_runner_makes_it_pull_without_a_request_hint(trio, live):
    # Our router's path: the hint goes to the target engine's runner, the request carries none.
    a, bs = trio
    b = bs["get"]
    text = prompt_text(150, 400)
    first = live.serve(a, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    mine = [h for h in a.stored_hashes() if h not in set(b.stored_hashes())]
    with ControlClient(b.endpoints["control"]) as client:
        assert client.request(m.PostHint(envelope=build_envelope(a.endpoints["control"], mine))).num_hashes == len(mine)
    pulled = live.generate(b, text)
    assert pulled["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert live.logprobs(pulled) == live.logprobs(first)
    wait_until(lambda: metric(a.runner_get("/metrics"), "kvcr_claims_held") == 0, timeout_s=10,
               message="A's claims released")
