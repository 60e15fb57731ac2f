"""Every decoder of outside input, fed arbitrary bytes and structures (hypothesis): it answers a
valid value or its own error type with a message naming the problem; it never raises anything
else, and never hangs (pytest-timeout)."""

import json

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcr.config import Config, ConfigError, _decode
from kvcr.proto import messages as m
from kvcr.proto.events import EventError, decode_batch, decode_frames
from kvcr.proto.hints import HintError, build_envelope, parse_envelope
from router_hints.http.config import RouterConfigError, parse_router_config
from kvcr.text import RequestError, TextTokenizer, request_tokens

pytestmark = pytest.mark.pure

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# JSON/msgpack-shaped values: what a peer or a client can actually send.
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20) \
    | st.binary(max_size=20)
def nested(leaves):
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                                           max_size=5), max_leaves=25)


values = nested(scalars)
# What msgpack can carry: integers within 64 bits.
wire = nested(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True)
              | st.text(max_size=20) | st.binary(max_size=20))


def refused(error_type, fn, *args) -> None:
    """Call fn: a value or error_type with a message; anything else fails the test."""
    try:
        fn(*args)
    except error_type as exc:
        assert str(exc).strip(), f"{error_type.__name__} without a message"


def packed(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@FUZZ
@given(st.binary(max_size=300) | wire.map(packed))
def test_event_batches_decode_or_are_refused_by_name(payload):
    refused(EventError, decode_batch, payload)


@FUZZ
@given(st.lists(st.binary(max_size=60), max_size=4))
def test_event_frames_decode_or_are_refused_by_name(frames):
    refused(EventError, decode_frames, frames)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]),
                          st.lists(wire, max_size=6)), max_size=4))
def test_events_with_the_right_tags_and_wrong_fields_are_refused_by_name(events):
    # Near misses: tagged like real events, fields arbitrary. A bad event is dropped with its
    # reason (batch.rejected), or the batch is refused as a whole.
    payload = packed([0.0, [[tag, *fields] for tag, fields in events], None])
    try:
        batch = decode_batch(payload)
    except EventError as exc:
        assert str(exc)
    else:
        assert all(reason for reason in batch.rejected)


@FUZZ
@given(st.binary(max_size=300) | wire.map(packed)
       | st.dictionaries(st.sampled_from(["t", "v", "id", "pool", "keys", "lease_s", "claim_id", "offsets"]), wire,
                         max_size=6).map(packed))
def test_control_messages_decode_or_are_refused_by_name(payload):
    refused(m.ProtocolError, m.decode, payload)


@FUZZ
@given(values)
def test_hint_envelopes_parse_or_are_refused_by_name(obj):
    refused(HintError, parse_envelope, obj)


@FUZZ
@given(st.text(max_size=30), st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4), st.text(max_size=10),
       st.sampled_from(["header", "payload", "actions", "version", "type"]), values)
def test_a_hint_with_one_field_changed_parses_or_is_refused_by_name(endpoint, hashes, mode, part, value):
    envelope = build_envelope(endpoint or "tcp://h:1", hashes)
    target = envelope if part in ("header", "payload") else envelope.get("header", envelope)
    target[part] = value
    refused(HintError, parse_envelope, envelope)


@FUZZ
@given(st.dictionaries(st.sampled_from(["runner", "dram", "events", "nvme", "namespace", "other"]),
                       st.dictionaries(st.sampled_from(["name", "size", "pools", "block_size", "control_endpoint",
                                                        "lease_seconds", "http_host", "curve_public_key", "write_policy",
                                                        "endpoint", "page_bytes", "storage_dir", "x"]), values,
                                       max_size=4) | values, max_size=4))
def test_runner_configs_load_or_are_refused_by_name(raw):
    refused(ConfigError, _decode, Config, "", raw)


@FUZZ
@given(st.dictionaries(st.sampled_from(["router", "workers", "cost", "other"]), values, max_size=3))
def test_router_configs_load_or_are_refused_by_name(raw):
    refused(RouterConfigError, parse_router_config, raw)


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer(None)


@FUZZ
@given(body=st.dictionaries(st.sampled_from(["text", "input_ids", "prompt", "messages", "chat_template_kwargs",
                                             "continue_final_message", "other"]), values, max_size=4),
       route=st.sampled_from(["generate", "completions", "chat"]))
def test_request_bodies_give_token_ids_or_are_refused_by_name(tokenizer, body, route):
    try:
        ids = request_tokens(body, route, tokenizer)
    except RequestError as exc:
        assert str(exc)
    else:
        assert all(isinstance(i, int) for i in ids)


@FUZZ
@given(blob=st.binary(max_size=200) | wire.map(lambda v: json.dumps(v, default=repr).encode()))
def test_config_files_load_or_are_refused_by_name(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("cfg") / "kvcr.json"
    path.write_bytes(blob)
    from kvcr.config import load_config

    try:
        load_config(path)
    except ConfigError as exc:
        assert str(exc).startswith(f"{path}: ") and str(exc) != f"{path}: ", exc  # the file, then the problem
    else:
        json.loads(blob)  # it loaded: it was JSON
