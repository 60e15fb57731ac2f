"""Peers registered in a real etcd (extra-config `peers_etcd`): held by a lease, renewed by the feed."""

import base64
import json
import logging
import time
import urllib.request

import pytest

from sglang_adapter.config import AdapterConfigError, parse_adapter_config
from sglang_adapter.peer_etcd import EtcdError, EtcdPeers, prefix_end
from tests.test_peer_directory import _info


@pytest.fixture
def registry(etcd):
    made = []

    def make(ttl_s: int = 10) -> EtcdPeers:
        made.append(EtcdPeers(etcd.endpoint, ttl_s=ttl_s))
        return made[-1]

    yield make
    for r in made:
        r.leave()


def test_each_runner_sees_the_others_entries_and_not_its_own(registry):
    a, b = registry(), registry()
    a.join(_info("tcp://127.0.0.1:5601", "a"))
    b.join(_info("tcp://127.0.0.1:5602", "b"))
    assert [e.control for e in a.entries().values()] == ["tcp://127.0.0.1:5602"]
    (entry,) = b.entries().values()
    assert entry.control == "tcp://127.0.0.1:5601" and entry.namespace_digests == {"ns1"}
    a.leave()
    assert b.entries() == {}


def test_a_runner_that_stops_renewing_leaves_with_its_lease_and_is_back_on_its_next_renewal(registry, caplog):
    a, b = registry(ttl_s=2), registry()
    a.join(_info("tcp://127.0.0.1:5601", "a"))
    b.join(_info("tcp://127.0.0.1:5602", "b"))
    deadline = time.monotonic() + 15
    while b.entries() and time.monotonic() < deadline:
        time.sleep(0.25)
    assert b.entries() == {}, "a's entry outlived its lease"
    caplog.set_level(logging.INFO, logger="sglang_adapter.peer_etcd")
    a.rejoin()
    assert "lease at" in caplog.text and [e.control for e in b.entries().values()] == ["tcp://127.0.0.1:5601"]


def test_a_value_that_is_not_a_runners_entry_is_skipped_with_a_warning(registry, etcd, caplog):
    key = b"kvcr/peers/not-a-runner"
    body = json.dumps({"key": base64.b64encode(key).decode(), "value": base64.b64encode(b"{}").decode()}).encode()
    urllib.request.urlopen(urllib.request.Request(etcd.endpoint + "/v3/kv/put", data=body), timeout=5).read()
    a = registry()
    assert a.entries() == {}
    assert "kvcr/peers/not-a-runner is not a runner's entry" in caplog.text


def test_an_unreachable_etcd_is_a_warning_at_join_and_named_by_the_feeds_calls(caplog):
    from kvcr.dynamo.local import free_port

    late = EtcdPeers(f"http://127.0.0.1:{free_port()}")
    late.join(_info("tcp://127.0.0.1:5601", "a"))  # refused: the engine starts all the same
    assert "not registered yet" in caplog.text
    for call in (late.entries, late.rejoin):
        with pytest.raises(EtcdError, match=late.endpoint):
            call()


def test_the_range_end_covers_exactly_the_prefix():
    assert prefix_end("kvcr/peers/") == "kvcr/peers0"


@pytest.mark.parametrize("value", ["127.0.0.1:2379", "etcd://h:2379", "tcp://h:2379"])
def test_peers_etcd_must_be_etcds_http_url(value):
    with pytest.raises(AdapterConfigError, match="peers_etcd' must be etcd's http"):
        parse_adapter_config({"peers_etcd": value})
