"""Dynamo's hints that cannot be honoured cost a miss, never a wrong answer or a held claim."""

from __future__ import annotations

import json
import signal

from kvcr.demo.httpc import http
from kvcr.proto.announce import announce_request
from kvcr.proto.hints import build_envelope
from tests.dynamo_live.helpers import BLOCK, MODEL, TOKENIZER, busy, first_holder, full_blocks, prompt, wait_for

LEASE_S = 10  # runner.lease_seconds: a claim granted after its puller gave up ends by then


def hinted(worker, source: str) -> bool:
    """The worker's bridge logged a Dynamo kv_hint naming `source`."""
    return any("Dynamo's kv_hint: pull" in line and source in line for line in worker.log_path.read_text().splitlines())


def clean(worker) -> dict:
    stats = worker.stats()["stats"]
    assert stats["oracle_mismatches"] == 0, stats
    return stats


def same_answer(worker, text: str, answer: dict) -> None:
    """The worker's own answer to `text` (from its cache, oracle-checked) equals the one Dynamo returned."""
    status, _, body = http(worker.url + "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 6})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == answer["choices"][0]["text"]


def test_a_holder_that_stops_answering_between_the_hint_and_the_pull_costs_a_miss(pair):
    fe, workers, probe = pair
    p = prompt("frozen")
    holder, other = first_holder(fe, workers, probe, p)
    source = holder.info["kvcr_runner"]["endpoints"]["control"]
    with busy(fe, holder, p):
        holder.proc.send_signal(signal.SIGSTOP)  # Dynamo still lists it, and still hints it as the source
        try:
            ask = p + " while the holder is frozen"
            answer = fe.complete(ask, max_tokens=6)
        finally:
            holder.proc.send_signal(signal.SIGCONT)
    assert hinted(other, source), "Dynamo should have named the frozen holder as the source"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed, and right:
    stats = clean(other)
    assert stats["peer_pages"] == 0
    same_answer(holder, ask, answer)
    wait_for(lambda: holder.claims_held() == 0, LEASE_S + 5, "no claim left at the holder")


def test_a_hint_naming_a_source_outside_the_trust_list_is_refused(dynamo):
    fe = dynamo.frontend()
    wa = dynamo.worker("wa")
    wb = dynamo.worker("wb", "--set", 'runner.peers=["tcp://127.0.0.1:9"]')  # trusts no runner here
    probe = dynamo.probe()
    p = prompt("trust")
    status, _, _ = http(wa.url + "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2})
    assert status == 200  # wa holds the prefix, and Dynamo learns it from wa's events
    wait_for(lambda: wa.held(probe, p).get("host") == full_blocks(p), 10, "wa's pages in Dynamo's index")
    source = wa.info["kvcr_runner"]["endpoints"]["control"]
    with busy(fe, wa, p):
        ask = p + " from a worker that does not trust wa"
        answer = fe.complete(ask, max_tokens=6)
    assert int(fe.selections()[-1]["worker_id"]) == wb.dynamo_id and hinted(wb, source)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stats = clean(wb)
    assert stats["peer_pages"] == 0 and stats["hint_errors"] == 1
    same_answer(wa, ask, answer)
    # A hint forged by a client straight to wb's own port, naming wa for pages it holds: refused too.
    p2 = prompt("forged")
    assert http(wa.url + "/v1/completions", {"model": MODEL, "prompt": p2, "max_tokens": 2})[0] == 200
    tokens = TOKENIZER.encode(p2)
    hashes = [a.event_hash for a in announce_request(tokens, BLOCK)]
    status, _, body = http(wb.url + "/generate", {"input_ids": tokens, "sampling_params": {"max_new_tokens": 2},
                                                  "kv_hint": build_envelope(source, hashes)})
    assert status == 200, body[:300]
    stats = wb.stats()["stats"]
    assert stats["peer_pages"] == 0 and stats["hint_errors"] == 2
    assert wa.claims_held() == 0
