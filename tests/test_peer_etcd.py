"""Peers registered in a real etcd (extra-config `peers_etcd`): held by a lease the registry renews itself."""

import subprocess
import sys
import time

import pytest

from kvcr.drivers.etcd import b64, call, prefix_end
from kvcr.dynamo.local import free_port
from sglang_adapter.config import AdapterConfigError, parse_adapter_config
from sglang_adapter.peer_etcd import EtcdError, EtcdPeers
from tests.helpers import runner_info, wait_until

# A registry in a process of its own, killed as an engine is: nothing revokes its lease.
REGISTER = """
import sys, time
from sglang_adapter.peer_etcd import EtcdPeers
from tests.helpers import runner_info
EtcdPeers(sys.argv[1], ttl_s=2).join(runner_info("tcp://127.0.0.1:5609", "killed"))
print("joined", flush=True)
time.sleep(600)
"""


@pytest.fixture
def registry(etcd):
    made = []

    def make(ttl_s: int = 10) -> EtcdPeers:
        made.append(EtcdPeers(etcd.endpoint, ttl_s=ttl_s))
        return made[-1]

    yield make
    for r in made:
        r.leave()


def put(etcd, key: bytes, value: bytes) -> None:
    call(etcd.endpoint, "/v3/kv/put", {"key": b64(key), "value": b64(value)})


def leases(etcd) -> list:
    return call(etcd.endpoint, "/v3/lease/leases", {}).get("leases", [])


def controls(r: EtcdPeers) -> list[str]:
    return [e.control for e in r.entries().values()]


def test_each_runner_sees_the_others_entries_and_not_its_own(registry, etcd):
    a, b = registry(), registry()
    a.join(runner_info("tcp://127.0.0.1:5601", "a"))
    b.join(runner_info("tcp://127.0.0.1:5602", "b"))
    assert controls(a) == ["tcp://127.0.0.1:5602"]
    (entry,) = b.entries().values()
    assert entry.control == "tcp://127.0.0.1:5601" and entry.namespace_digests == {"ns1"}
    a.leave()
    assert b.entries() == {} and len(leases(etcd)) == 1  # a's lease revoked with it


def test_a_registry_keeps_its_entry_past_many_leases_with_no_help(registry):
    """Its own thread renews the lease: an engine that follows nobody (opportunistic off) stays
    findable by those that do."""
    a, b = registry(ttl_s=4), registry()
    a.join(runner_info("tcp://127.0.0.1:5601", "a"))
    time.sleep(9)
    assert controls(b) == ["tcp://127.0.0.1:5601"]


def test_a_killed_engines_entry_ends_with_its_lease(registry, etcd):
    child = subprocess.Popen([sys.executable, "-c", REGISTER, etcd.endpoint], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "joined"
        watcher = registry()
        assert controls(watcher) == ["tcp://127.0.0.1:5609"]
        child.kill()
        child.wait(10)
        wait_until(lambda: watcher.entries() == {}, 15, 0.25, "the killed engine's entry ended with its lease")
    finally:
        child.kill()
        child.wait(10)


def test_a_put_etcd_refuses_leaves_no_lease_behind_and_is_named(registry, etcd, caplog):
    """etcd refuses a request over its size limit (1.5 MiB): the lease granted for it is revoked."""
    big = registry()
    big.join({**runner_info("tcp://127.0.0.1:5601", "big"), "padding": "x" * (2 << 20)})
    assert "peers_etcd: not registered" in caplog.text
    assert leases(etcd) == [] and controls(registry()) == []


def test_a_value_that_is_not_a_runners_entry_is_skipped_with_a_warning(registry, etcd, caplog):
    put(etcd, b"kvcr/peers/not-a-runner", b"{}")
    assert registry().entries() == {}
    assert "kvcr/peers/not-a-runner is not a runner's entry" in caplog.text


def test_an_unreachable_etcd_is_a_warning_at_join_and_named_when_listed(caplog):
    late = EtcdPeers(f"http://127.0.0.1:{free_port()}")
    try:
        late.join(runner_info("tcp://127.0.0.1:5601", "a"))  # refused: the engine starts all the same
        assert "peers_etcd: not registered" in caplog.text
        with pytest.raises(EtcdError, match=late.endpoint):
            late.entries()
    finally:
        late.leave()


def test_the_range_end_covers_exactly_the_prefix():
    assert prefix_end("kvcr/peers/") == "kvcr/peers0"


@pytest.mark.parametrize("value", ["127.0.0.1:2379", "etcd://h:2379", "tcp://h:2379"])
def test_peers_etcd_must_be_etcds_http_url(value):
    with pytest.raises(AdapterConfigError, match="peers_etcd' must be etcd's http"):
        parse_adapter_config({"peers_etcd": value})
