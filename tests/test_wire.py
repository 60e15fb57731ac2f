"""Event batches, control messages and hint envelopes: encoding, decoding and rejection."""

import msgpack
import pytest

from kvcr.proto import events as ev
from kvcr.proto import hints, messages

pytestmark = pytest.mark.pure


def stored(**kw):
    base = dict(block_hashes=(11, 12), parent_block_hash=None, token_ids=tuple(range(32)), block_size=16,
                medium="GPU", lora_name=None)
    return ev.BlockStored(**{**base, **kw})


def test_batch_bytes_match_vllm_encoder_layout():
    batch = ev.EventBatch(ts=1700000000.5, events=(stored(), ev.BlockRemoved(block_hashes=(11,), medium="GPU"),
                                                   ev.AllBlocksCleared()), dp_rank=0)
    raw = batch.encode()
    # [ts float64, [ {fixmap 8: "type": "BlockStored", ...} ...], 0]: vLLM's layout, type first.
    assert raw[:12] == bytes.fromhex("93cb41d954fc402000009388")
    assert raw[12:29] == b"\xa4type\xabBlockStored"
    decoded = msgpack.unpackb(raw)
    assert decoded[0] == 1700000000.5 and decoded[2] == 0
    first = decoded[1][0]
    assert list(first)[0] == "type" and "ownership" not in first
    assert first["lora_id"] is None and first["parent_block_hash"] is None
    assert decoded[1][2] == {"type": "AllBlocksCleared"}
    assert ev.decode_batch(raw) == batch


def test_positional_events_from_older_publishers_decode():
    raw = msgpack.packb([1.0, [["BlockStored", [1, 2], None, list(range(8)), 4, None, "CPU_PINNED",
                                {"cache_salt": "t"}], ["BlockRemoved", [1], "CPU_PINNED"]], None])
    batch = ev.decode_batch(raw)
    assert batch.events[0].cache_salt == "t" and batch.events[0].medium == "CPU_PINNED"
    assert batch.events[1] == ev.BlockRemoved(block_hashes=(1,), medium="CPU_PINNED")


@pytest.mark.parametrize("payload,problem", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1.0, []]), "3-element"),
    (msgpack.packb(["x", [], 0]), "ts must be a number"),
    (msgpack.packb([1.0, {}, 0]), "events must be an array"),
    (msgpack.packb([1.0, [], -1]), "dp_rank"),
])
def test_malformed_frames_are_rejected_naming_the_problem(payload, problem):
    with pytest.raises(ev.EventError, match=problem):
        ev.decode_batch(payload)


@pytest.mark.parametrize("event,problem", [
    ({"type": "Bogus"}, "unknown event type"),
    ({"type": "BlockStored"}, "lacks field"),
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
      "block_size": 16}, "token_ids has 2 tokens"),
    ({"type": "BlockStored", "block_hashes": [b"raw"], "parent_block_hash": None, "token_ids": [],
      "block_size": 16}, "64-bit integer"),
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": 5,
      "block_size": 1}, "malformed event"),
    ({"type": "BlockRemoved", "block_hashes": [1], "medium": "DRAM"}, "medium"),
    ({"type": "BlockRemoved", "block_hashes": [1], "ownership": "kvcr"}, "ownership"),
    ({"type": "BlockRemoved", "block_hashes": [1, 2.5]}, "64-bit integer"),
    ([["x"], 1], "unknown positional event type"),
    ("text", "must be a map or an array"),
])
def test_a_malformed_event_is_dropped_with_its_reason_and_the_rest_kept(event, problem):
    good = {"type": "AllBlocksCleared"}
    batch = ev.decode_batch(msgpack.packb([1.0, [event, good], 0]))
    assert batch.events == (ev.AllBlocksCleared(),)
    assert len(batch.rejected) == 1 and problem in batch.rejected[0]


def test_unmodelled_fields_of_relayed_events_are_kept_on_the_wire():
    raw = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": list(range(17)),
           "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 1,
           "kv_cache_spec_kind": "sliding_window", "extra_keys": [["s"]]}
    event = ev.decode_event(raw)
    assert event.to_wire() == raw  # EAGLE's extra token and the fields routers filter on survive


@pytest.mark.parametrize("frames,problem", [([b"", b"\x00" * 7, b""], "8 bytes"), ([b""], "3 frames")])
def test_malformed_frames_are_rejected(frames, problem):
    with pytest.raises(ev.EventError, match=problem):
        ev.decode_frames(frames)


def test_block_stored_refuses_duplicates_and_self_parent():
    with pytest.raises(ev.EventError, match="duplicate"):
        stored(block_hashes=(1, 1))
    with pytest.raises(ev.EventError, match="own parent"):
        stored(parent_block_hash=11)


# --- control messages ------------------------------------------------------------------------------

def test_control_message_round_trip_keeps_version_and_ids():
    msg = messages.ClaimRequest(request_id=7, incarnation="abc", pool="kv", keys=["a" * 64], lease_s=2.5)
    assert messages.decode(messages.encode(msg)) == msg


def test_newer_minor_version_fields_are_ignored():
    raw = msgpack.packb({"type": "lookup", "version": [1, 9], "keys": [], "future_field": 1})
    assert messages.decode(raw).version == (1, 9)


@pytest.mark.parametrize("raw,code,problem", [
    (b"\xc1", "bad_request", "not msgpack"),
    (msgpack.packb([1]), "bad_request", "must be a map"),
    (msgpack.packb({"type": "nope"}), "unknown_type", "unknown"),
    (msgpack.packb({"type": "lookup", "keys": "x"}), "bad_request", "lookup.keys must be list"),
    (msgpack.packb({"type": "lookup", "version": [2, 0]}), "version", "major version 2"),
    (msgpack.packb({"type": "lookup", "version": "1.0"}), "bad_request", "major, minor"),
    (msgpack.packb({"type": "renew", "claim_id": True}), "bad_request", "claim_id must be int"),
    (msgpack.packb({"type": "lookup", "keys": ["a" * 64, 7]}), "bad_request", r"lookup.keys must be list\[str\], item 1 is int"),
    (msgpack.packb({"type": "granted", "offsets": [0, 4096.0]}), "bad_request", r"granted.offsets .* item 1 is float"),
    (msgpack.packb({"type": "send_pages", "ops": [[0, 4096]]}), "bad_request", r"send_pages.ops must be .*\[0, 4096\]"),
    (msgpack.packb({"type": "released", "live": [True, 1]}), "bad_request", r"released.live .* item 1 is int"),
])
def test_bad_control_frames_are_refused_with_a_reason(raw, code, problem):
    with pytest.raises(messages.ProtocolError, match=problem) as info:
        messages.decode(raw)
    assert info.value.code == code


# --- hints -------------------------------------------------------------------------------------------

def envelope(**payload):
    body = {"source_control_endpoint": "tcp://h:1", "block_hashes": [1, 2], **payload}
    return {"protocol_version": "0.1", "message_id": "m", "actions": [
        {"action_id": "a0", "action_type": "other", "action_version": "1.0", "payload": {}},
        {"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0", "payload": body}]}


def test_hint_envelope_round_trip_uses_first_fetch_action():
    built = hints.build_envelope("tcp://h:1", [5, -1])
    hint = hints.parse_envelope(built)
    assert hint.block_hashes == (5, (1 << 64) - 1) and hint.mode == "copy" and not hint.warnings
    assert hints.parse_envelope(envelope()).source_control_endpoint == "tcp://h:1"


def test_hint_version_mismatch_only_warns():
    env = envelope()
    env["protocol_version"] = "0.2"
    assert hints.parse_envelope(env).warnings


@pytest.mark.parametrize("change,problem", [
    ({"source_control_endpoint": ""}, "non-empty string"),
    ({"block_hashes": []}, "non-empty list"),
    ({"block_hashes": [True]}, r"\[0, 2\^64\)"),
    ({"block_hashes": [-1]}, r"\[0, 2\^64\)"),
    ({"block_hashes": [1 << 64]}, r"\[0, 2\^64\)"),
    ({"mode": "move"}, "move"),
    ({"mode": "teleport"}, "mode"),
    ({"no_retain": True}, "no_retain"),
])
def test_bad_hints_are_rejected_with_the_reason(change, problem):
    with pytest.raises(hints.HintError, match=problem):
        hints.parse_envelope(envelope(**change))


def test_the_dynamo_advertisement_names_each_dp_ranks_control_endpoint():
    adv = hints.dynamo_advertisement({1: "tcp://w:5601", 0: "tcp://w:5600"}, "prefill")
    assert adv == {"router_hint": True, "router_hint_worker_type": "prefill",
                   "router_hint_source_control_endpoints": {"0": "tcp://w:5600", "1": "tcp://w:5601"}}


@pytest.mark.parametrize("endpoints, worker_type, problem", [
    ({0: "tcp://w:1"}, "mixed", "worker_type must be one of"),
    ({}, "aggregated", "at least one control endpoint"),
    ({-1: "tcp://w:1"}, "aggregated", "non-negative integers"),
    ({0: "http://w:1"}, "aggregated", "is not a ZMQ endpoint"),
])
def test_a_bad_dynamo_advertisement_is_refused(endpoints, worker_type, problem):
    with pytest.raises(hints.HintError, match=problem):
        hints.dynamo_advertisement(endpoints, worker_type)


def test_move_mode_only_where_allowed_and_legacy_flat_form():
    assert hints.parse_envelope(envelope(mode="move"), allow_move=True).mode == "move"
    flat = {"source_control_endpoint": "tcp://h:2", "block_hashes": [3]}
    assert hints.parse_envelope(flat).block_hashes == (3,)
    assert hints.extract_request_hint({"kv_transfer_params": {"router_hint": flat}}) == flat
    with pytest.raises(hints.HintError, match="source-less"):
        hints.parse_envelope({"protocol_version": "0.1", "actions": [
            {"action_type": "kv.fetch", "action_version": "1.0", "payload": {"block_hashes": [1]}}]})


def test_publisher_overflow_drops_a_batch_but_leaves_a_visible_gap():
    import zmq

    from kvcr.drivers.zmq_events import EventPublisher, SeqSource
    from kvcr.proto.stream import StreamTracker, Verdict

    ctx = zmq.Context()
    pub = EventPublisher(ctx, endpoint="inproc://ovf", replay_endpoint="inproc://ovf-replay", queue_size=2,
                         seq=SeqSource(now_us=100), heartbeat_s=0)
    seqs = [pub.publish([ev.AllBlocksCleared()]) for _ in range(4)]  # not started: nothing drains
    assert seqs == [100, 101, 102, 103] and pub.num_dropped == 2
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub.start()
    sub.connect("inproc://ovf")
    import time
    time.sleep(0.2)
    last = pub.publish([ev.AllBlocksCleared()])
    seq = None
    while seq != last:  # 100 and 101 may still reach a SUB that connected before the first drain
        assert sub.poll(2000)
        seq = ev.decode_seq(sub.recv_multipart()[1])
        assert seq in (100, 101, last), f"seq {seq}: a dropped batch went out"
    tracker = StreamTracker(last=101)
    assert tracker.classify(seq)[0] is Verdict.GAP  # 102 and 103 never went out
    pub.stop()
    sub.close()
    ctx.term()


def test_seq_source_rises_across_restarts_even_if_the_clock_goes_back(tmp_path):
    from kvcr.drivers.zmq_events import SEQ_RESERVATION, SeqSource

    first = SeqSource(str(tmp_path), now_us=5_000)
    taken = [first.take() for _ in range(3)]
    second = SeqSource(str(tmp_path), now_us=10)  # the clock went back
    assert second.take() > taken[-1] and second.next <= 5_000 + SEQ_RESERVATION + 1


def test_posted_hints_name_a_source_for_the_leading_hinted_pages_until_their_ttl():
    from kvcr.proto.hintbook import HintBook

    book = HintBook(ttl_s=10, max_hashes=4)
    book.post(hints.parse_envelope(hints.build_envelope("tcp://a:1", [1, 2, 3])), now=0)
    src = book.source_for([1, 2, 3, 4], now=5)
    assert (src.endpoint, src.num_pages, src.mode) == ("tcp://a:1", 3, "copy")
    assert book.source_for([-1 & ((1 << 64) - 1), 1], now=5) is None  # the first page is not hinted
    assert book.source_for([1, 2], now=10) is None  # expired
    book.post(hints.parse_envelope(hints.build_envelope("tcp://b:1", [7, 8, 9])), now=0)
    assert len(book) == 4 and book.num_evicted == 2  # the cap drops the oldest hashes
    assert book.expire(now=11) == 4 and len(book) == 0


def test_a_multi_block_announce_round_trips_and_must_end_with_its_event_hash():
    from kvcr.proto.announce import Announce
    from kvcr.proto.events import EventError

    span = Announce(event_hash=3, parent_hash=None, token_ids=tuple(range(8)), blocks=(1, 2, 3, 3 + 0))
    assert Announce.from_wire(span.to_wire()) == span and len(span.to_wire()) == 6
    plain = Announce(event_hash=3, parent_hash=None, token_ids=(1, 2))
    assert len(plain.to_wire()) == 5 and plain.block_hashes == (3,)  # older peers read it unchanged
    with pytest.raises(EventError, match="ends with its event_hash"):
        Announce(event_hash=3, parent_hash=None, token_ids=tuple(range(8)), blocks=(3, 4))
