"""DynamoFeed (what Dynamo is told about one runner), the bridge's start-up checks and its request
translation: pure."""

from __future__ import annotations

import json
import re

import pytest

from kvcr.dynamo.bridge import BridgeError, dead_after, runner_view
from kvcr.dynamo.requests import BridgeRequestError, StreamDecoder, generate_body
from kvcr.proto.dynamo_feed import DynamoFeed, Phase
from kvcr.proto.events import MEDIUM_DISK, MEDIUM_DRAM, AllBlocksCleared, BlockRemoved, BlockStored

pytestmark = pytest.mark.pure

CLEAR = AllBlocksCleared()


def stored(*hashes: int, medium: str = MEDIUM_DRAM, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tuple(range(4 * len(hashes))),
                       block_size=4, medium=medium)


@pytest.fixture
def live() -> DynamoFeed:
    feed = DynamoFeed(dead_after_s=3.0)
    feed.subscribed(0.0)
    feed.snapshot([stored(1, 2)], 0.0)
    return feed


def test_nothing_is_published_before_the_relay_subscribes():
    feed = DynamoFeed(dead_after_s=3.0)
    assert feed.batch((stored(1),), 0.0) == () and feed.lost(0.0, "restart") == () and feed.tick(99.0) == ()
    assert feed.phase is Phase.WAITING and not feed.wants_snapshot


def test_a_subscription_clears_the_view_and_the_snapshot_fills_it():
    feed = DynamoFeed(dead_after_s=3.0)
    assert feed.subscribed(0.0) == (CLEAR,)
    assert feed.wants_snapshot
    assert feed.batch((stored(9),), 0.1) == ()  # older than the coming snapshot: covered by it
    snap = [stored(1, 2), stored(3, medium=MEDIUM_DISK)]
    assert feed.snapshot(snap, 0.2) == (CLEAR, *snap)
    assert feed.phase is Phase.LIVE and feed.blocks(MEDIUM_DRAM) == 2 and feed.blocks(MEDIUM_DISK) == 1
    assert feed.snapshot(snap, 0.3) == ()  # a second answer is not applied twice


def test_live_batches_pass_unchanged_and_dynamos_reference_counts_are_mirrored(live):
    events = (stored(3, parent=2), stored(3, parent=2), BlockRemoved(block_hashes=(3,)))
    assert live.batch(events, 1.0) == events
    assert live.told[(MEDIUM_DRAM, 3)] == 1  # two stores, one removal: Dynamo still holds it
    live.batch((BlockRemoved(block_hashes=(3, 1)),), 1.1)
    assert live.blocks(MEDIUM_DRAM) == 1


@pytest.mark.parametrize("why", ["restart: seq went back to 0", "lost: batches [4, 9) not repaired"])
def test_a_restart_or_unrepaired_gap_clears_the_view_until_a_new_snapshot(live, why):
    assert live.lost(2.0, why) == (CLEAR,)
    assert live.wants_snapshot and live.blocks(MEDIUM_DRAM) == 0 and live.last_problem == why
    assert live.batch((stored(5),), 2.1) == ()
    assert live.snapshot([stored(5)], 2.2) == (CLEAR, stored(5))


def test_a_silent_runner_is_cleared_once_and_resynced_when_heard_again(live):
    assert live.tick(2.9) == ()
    assert live.tick(3.0) == (CLEAR,)
    assert live.phase is Phase.DEAD and live.tick(10.0) == ()
    assert live.batch((), 11.0) == ()  # its heartbeat: back, but what it holds comes from its snapshot
    assert live.wants_snapshot
    assert live.snapshot([], 11.1) == (CLEAR,)
    assert live.phase is Phase.LIVE and live.num_resyncs == 2


def test_heartbeats_keep_a_live_runner_alive(live):
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        live.batch((), t)
        assert live.tick(t + 0.5) == ()


def dynamo_request(**over) -> dict:
    return {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 5}, "sampling_options": {}, **over}


def test_a_dynamo_request_becomes_a_streamed_greedy_generate_with_its_hint():
    hint = {"protocol_version": "0.1", "actions": []}
    body = generate_body(dynamo_request(kv_hint=hint), default_max_tokens=16)
    assert body == {"input_ids": [1, 2, 3], "stream": True, "kv_hints": hint,
                    "sampling_params": {"max_new_tokens": 5, "ignore_eos": False, "temperature": 0.0}}
    assert generate_body(dynamo_request(stop_conditions={}), default_max_tokens=16,
                         oracle=True)["sampling_params"]["max_new_tokens"] == 16


@pytest.mark.parametrize("routing, salt", [({"dp_rank": 0, "cache_salt": "tenant-a"}, "tenant-a"),
                                           ({"dp_rank": 0}, None), ({"cache_salt": ""}, None)])
def test_the_tenant_salt_dynamo_routed_on_reaches_the_engine(routing, salt):
    """Dynamo 1.6.1 puts a request's `nvext.cache_salt` in `routing.cache_salt` (seen on the wire)."""
    assert generate_body(dynamo_request(routing=routing), default_max_tokens=16).get("cache_salt") == salt


@pytest.mark.parametrize("routing, ranks, routed", [({"dp_rank": 1}, (0, 1), 1), ({}, (0, 1), None),
                                                   ({"dp_rank": 1}, None, None)])
def test_a_dp_engines_request_runs_on_the_rank_dynamo_routed_it_to(routing, ranks, routed):
    """One bridge serves every DP rank of an engine; a one-rank engine is left to itself."""
    body = generate_body(dynamo_request(routing=routing), default_max_tokens=16, ranks=ranks)
    assert body.get("routed_dp_rank") == routed


@pytest.mark.parametrize("request_, problem", [
    ([], "must be an object"),
    (dynamo_request(token_ids=[]), "token_ids"),
    (dynamo_request(token_ids=[1, "2"]), "token_ids"),
    (dynamo_request(stop_conditions=[]), "stop_conditions must be an object"),
    (dynamo_request(stop_conditions={"max_tokens": -1}), "max_tokens must be a non-negative integer"),
    (dynamo_request(routing=[]), "routing must be an object"),
    (dynamo_request(routing={"cache_salt": 7}), "cache_salt must be a string"),
])
def test_a_malformed_dynamo_request_is_refused_by_name(request_, problem):
    with pytest.raises(BridgeRequestError, match=problem):
        generate_body(request_, default_max_tokens=16)


@pytest.mark.parametrize("dp_rank, problem", [(2, r"routing.dp_rank 2 is not one of this engine's DP ranks \[0, 1\]"),
                                              (-1, "dp_rank must be a non-negative integer")])
def test_a_dp_rank_the_engine_does_not_have_is_refused_by_name(dp_rank, problem):
    with pytest.raises(BridgeRequestError, match=problem):
        generate_body(dynamo_request(routing={"dp_rank": dp_rank}), default_max_tokens=16, ranks=(0, 1))


def test_a_request_for_another_model_such_as_a_lora_is_refused():
    """Dynamo names a LoRA in `model`; the bridge registered the base model only."""
    assert generate_body(dynamo_request(model="tiny-llama"), default_max_tokens=16, model="tiny-llama")
    with pytest.raises(BridgeRequestError, match="this bridge serves only 'tiny-llama'"):
        generate_body(dynamo_request(model="tiny-llama-lora-x"), default_max_tokens=16, model="tiny-llama")


def sse(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n"


def test_cumulative_output_ids_become_per_step_chunks_with_a_final_usage():
    decoder = StreamDecoder()
    assert decoder.feed(sse({"output_ids": [7]})) == {"index": 0, "token_ids": [7]}
    assert decoder.feed(b"\n") is None
    last = decoder.feed(sse({"output_ids": [7, 8, 9], "meta_info": {
        "finish_reason": {"type": "length"}, "prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 2}}))
    assert last["token_ids"] == [8, 9] and last["finish_reason"] == "length"
    assert last["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert decoder.finished and decoder.feed(b"data: [DONE]\n") is None


@pytest.mark.parametrize("line, problem", [(b"data: {not json\n", "malformed JSON"),
                                           (sse({"error": "boom"}), "failed the request: boom")])
def test_an_engine_stream_error_is_named(line, problem):
    with pytest.raises(BridgeRequestError, match=problem):
        StreamDecoder().feed(line)


def test_a_resubscription_while_live_starts_the_view_over(live):
    assert live.subscribed(5.0) == (CLEAR,)
    assert live.wants_snapshot and not live.told
    assert live.snapshot([stored(7)], 5.1) == (CLEAR, stored(7))


def test_a_loss_while_dead_keeps_the_view_cleared_until_a_snapshot(live):
    live.tick(10.0)
    assert live.phase is Phase.DEAD
    assert live.lost(10.5, "restart: seq went back to 0") == (CLEAR,)
    assert live.wants_snapshot


@pytest.mark.parametrize("phase", ["waiting", "live"])
def test_a_snapshot_outside_a_resync_is_not_applied(live, phase):
    feed = DynamoFeed(dead_after_s=3.0) if phase == "waiting" else live
    assert feed.snapshot([stored(9)], 1.0) == ()
    assert (MEDIUM_DRAM, 9) not in feed.told


def test_without_heartbeats_a_silent_runner_is_never_declared_dead():
    feed = DynamoFeed(dead_after_s=0.0)
    feed.subscribed(0.0)
    feed.snapshot([stored(1)], 0.0)
    assert feed.tick(1e6) == () and feed.phase is Phase.LIVE


def runner_info(**over) -> dict:
    return {"dp_rank": 0, "block_size": 16, "heartbeat_s": 1.0, "pools": [{"num_slots": 64}],
            "endpoints": {"events": "tcp://h:1", "replay": "tcp://h:2", "control": "tcp://h:3"}, **over}


@pytest.mark.parametrize("heartbeat, explicit, expected", [(1.0, None, 5.0), (0.0, None, 0.0), (1.0, 2.5, 2.5)])
def test_the_silence_that_clears_dynamos_view_follows_the_runners_heartbeat(heartbeat, explicit, expected):
    view = runner_view(runner_info(heartbeat_s=heartbeat), dp_rank=None)
    assert dead_after(view, explicit) == expected


@pytest.mark.parametrize("info, dp_rank, problem", [
    (runner_info(dp_rank=1), 0, "--dp-rank 0 differs from the runner's runner.dp_rank 1"),
    (runner_info(endpoints={"events": "tcp://h:1"}), None, "names no events or control endpoint"),
])
def test_a_runner_the_bridge_cannot_serve_is_refused_at_start(info, dp_rank, problem):
    with pytest.raises(BridgeError, match=re.escape(problem)):
        runner_view(info, dp_rank=dp_rank)
