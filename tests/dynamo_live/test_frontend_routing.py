"""Dynamo's frontend routes `kvcr worker --dynamo` processes from their own events, and its hints pull."""

from __future__ import annotations

import json

from kvcr.demo.httpc import http
from tests.dynamo_live.helpers import (BLOCK, MODEL, TOKENIZER, busy, first_holder, full_blocks, prompt, salted,
                                        wait_for)


def oracle_clean(*workers) -> None:
    for w in workers:
        stats = w.stats()["stats"]
        assert stats["oracle_mismatches"] == 0 and stats["hint_errors"] == 0, (w.name, stats)


def test_a_follow_up_goes_to_the_worker_dynamo_saw_store_the_prefix(pair):
    fe, workers, probe = pair
    p = prompt("topic")
    # Dynamo's own index: the holder's DRAM pages count as host-pinned, nothing at the other worker.
    holder, other = first_holder(fe, workers, probe, p)
    assert other.served() == 0 and other.held(probe, p).get("host") == 0
    follow = fe.complete(p + " and then a follow-up question", max_tokens=6)
    assert holder.served() == 2 and other.served() == 0
    # the frontend tokenizes as the worker does
    assert follow["usage"]["prompt_tokens"] == len(TOKENIZER.encode(p + " and then a follow-up question"))
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks(p) * BLOCK
    choice = fe.selections()[-1]
    assert int(choice["worker_id"]) == holder.dynamo_id and int(choice["host_pinned_blocks"]) == full_blocks(p)
    # The oracle: the other worker (same weights) computing the prompt from nothing answers the same.
    status, _, body = http(other.url + "/v1/completions", {"model": MODEL, "max_tokens": 6,
                                                            "prompt": p + " and then a follow-up question"})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == follow["choices"][0]["text"]
    oracle_clean(*workers)
    assert holder.stats()["stats"]["oracle_checks"] >= 1


def test_a_busy_holder_makes_dynamo_hint_the_other_worker_which_pulls_over_ucx(pair):
    fe, workers, probe = pair
    p = prompt("shared")
    holder, other = first_holder(fe, workers, probe, p)
    with busy(fe, holder, p):
        answer = fe.complete(p + " with another question", max_tokens=6)
    choice = fe.selections()[-1]
    assert int(choice["worker_id"]) == other.dynamo_id, "Dynamo should prefer the idle worker"
    stats = other.stats()
    assert stats["stats"]["peer_pages"] == full_blocks(p), stats["stats"]  # pulled on Dynamo's kv_hint
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks(p) * BLOCK
    oracle_clean(*workers)
    wait_for(lambda: holder.claims_held() == 0, 10, "the holder's claims released")
    # Both inventories now show in Dynamo's router: the pulled pages were kept and announced.
    wait_for(lambda: other.held(probe, p).get("host") == full_blocks(p), 10, "the pulled pages in Dynamo")
    assert holder.held(probe, p).get("host") == full_blocks(p)


def test_a_tenants_pages_stay_in_its_namespace_in_dynamo_and_its_own_salt_pulls_on_the_hint(pair):
    """`nvext.cache_salt` through Dynamo's frontend: the worker keys and announces the pages under
    the salt, Dynamo files them under that namespace, another salt or none is served nothing of
    them, and the same salt, its holder busy, pulls them on Dynamo's hint."""
    fe, workers, probe = pair
    p = prompt("tenant")
    holder, other = first_holder(fe, workers, probe, p, "tenant-a")
    assert holder.held(probe, p).get("host") == holder.held(probe, p, "tenant-b").get("host") == 0
    for salt in (None, "tenant-b"):
        answer = fe.complete(p, **salted(salt))
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, salt
    assert other.stats()["stats"]["peer_pages"] == 0
    with busy(fe, holder, p, "tenant-a"):
        answer = fe.complete(p + " with another question", max_tokens=6, **salted("tenant-a"))
    assert int(fe.selections()[-1]["worker_id"]) == other.dynamo_id, "Dynamo should prefer the idle worker"
    assert other.stats()["stats"]["peer_pages"] == full_blocks(p)  # pulled on Dynamo's kv_hint
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks(p) * BLOCK
    oracle_clean(*workers)
    wait_for(lambda: other.held(probe, p, "tenant-a").get("host") == full_blocks(p), 10,
             "the pulled pages in Dynamo, under the tenant's namespace")


def test_a_worker_with_keys_hands_them_to_its_bridge_which_follows_its_curve_events(dynamo, tmp_path):
    """With `runner.keys_dir` the runner's events, replay and control speak CURVE: the worker gives
    its bridge the deployment keys, so Dynamo still learns every page it stores."""
    from kvcr import curve_keys as keys

    keys.init(tmp_path / "keys")
    fe = dynamo.frontend()
    secured = dynamo.worker("wk", "--set", f"runner.keys_dir={tmp_path / 'keys'}")
    probe = dynamo.probe()
    p = prompt("secured")
    fe.complete(p)
    assert secured.served() == 1
    wait_for(lambda: secured.held(probe, p).get("host") == full_blocks(p), 20, "the secured worker's pages in Dynamo")
