"""Dynamo's frontend routes `kvcr worker --dynamo` processes from their own events, and its hints pull."""

from __future__ import annotations

import json
import threading

import pytest

from kvcr.demo.httpc import http
from router_hints.text import TextTokenizer
from tests.dynamo_live.conftest import BLOCK, MODEL, wait_for

TOKENIZER = TextTokenizer()


def prompt(tag: str, words: int = 120) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


def full_blocks(text: str) -> int:
    return len(TOKENIZER.encode(text)) // BLOCK


@pytest.fixture
def pair(dynamo):
    fe = dynamo.frontend()
    workers = [dynamo.worker("wa"), dynamo.worker("wb")]
    probe = dynamo.probe()
    wait_for(lambda: len(probe.overlaps(TOKENIZER.encode("warm up"))) == 2, 60, "both workers in Dynamo's router")
    return fe, workers, probe


def served(worker) -> int:
    return worker.stats()["stats"]["requests"]


def held_by(probe, worker, text: str) -> dict:
    return probe.overlaps(TOKENIZER.encode(text)).get((worker.dynamo_id, 0), {})


def oracle_clean(*workers) -> None:
    for w in workers:
        stats = w.stats()["stats"]
        assert stats["oracle_mismatches"] == 0 and stats["hint_errors"] == 0, (w.name, stats)


def test_a_follow_up_goes_to_the_worker_dynamo_saw_store_the_prefix(pair):
    fe, (wa, wb), probe = pair
    p = prompt("topic")
    first = fe.complete(p)
    holder, other = (wa, wb) if served(wa) == 1 else (wb, wa)
    assert served(holder) == 1 and served(other) == 0
    assert first["usage"]["prompt_tokens"] == len(TOKENIZER.encode(p))  # the frontend tokenizes as the worker
    # Dynamo's own index: the holder's DRAM pages count as host-pinned, nothing at the other worker.
    wait_for(lambda: held_by(probe, holder, p).get("host") == full_blocks(p), 10, "the prefix in Dynamo's index")
    assert held_by(probe, other, p).get("host") == 0
    follow = fe.complete(p + " and then a follow-up question", max_tokens=6)
    assert served(holder) == 2 and served(other) == 0
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks(p) * BLOCK
    choice = fe.selections()[-1]
    assert int(choice["worker_id"]) == holder.dynamo_id and int(choice["host_pinned_blocks"]) == full_blocks(p)
    # The oracle: the other worker (same weights) computing the prompt from nothing answers the same.
    status, _, body = http(other.url + "/v1/completions", {"model": MODEL, "max_tokens": 6,
                                                            "prompt": p + " and then a follow-up question"})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == follow["choices"][0]["text"]
    oracle_clean(wa, wb)
    assert holder.stats()["stats"]["oracle_checks"] >= 1


def test_a_busy_holder_makes_dynamo_hint_the_other_worker_which_pulls_over_ucx(pair):
    fe, (wa, wb), probe = pair
    p = prompt("shared")
    fe.complete(p)
    holder, other = (wa, wb) if served(wa) == 1 else (wb, wa)
    wait_for(lambda: held_by(probe, holder, p).get("host") == full_blocks(p), 10, "the prefix in Dynamo's index")
    # A long request sharing the prefix keeps the holder busy: Dynamo counts its blocks as load.
    long_done = threading.Event()
    errors: list[BaseException] = []

    def long_request() -> None:
        try:
            fe.complete(p + " " + prompt("tail", 700), max_tokens=200, ignore_eos=True)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
        finally:
            long_done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    try:
        wait_for(lambda: holder.stats()["inflight"] >= 1 or long_done.is_set(), 60, "the holder busy")
        answer = fe.complete(p + " with another question", max_tokens=6)
    finally:
        thread.join(240)
    assert not errors, errors
    choice = fe.selections()[-1]
    assert int(choice["worker_id"]) == other.dynamo_id, "Dynamo should prefer the idle worker"
    stats = other.stats()
    assert stats["stats"]["peer_pages"] == full_blocks(p), stats["stats"]  # pulled on Dynamo's kv_hint
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks(p) * BLOCK
    oracle_clean(wa, wb)
    wait_for(lambda: holder.claims_held() == 0, 10, "the holder's claims released")
    # Both inventories now show in Dynamo's router: the pulled pages were kept and announced.
    wait_for(lambda: held_by(probe, other, p).get("host") == full_blocks(p), 10, "the pulled pages in Dynamo")
    assert held_by(probe, holder, p).get("host") == full_blocks(p)
