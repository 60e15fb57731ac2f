"""One engine's DP ranks from one runner config: each rank's endpoints and directories, the port
range checked on every rank before any binds, and wildcard binds published as a reachable host."""

import pytest

from kvcr.config import ConfigError, load_config
from kvcr.ranks import advertised, for_rank, rank_endpoint

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("endpoint,rank,expected", [
    ("tcp://0.0.0.0:5600", 0, "tcp://0.0.0.0:5600"),
    ("tcp://10.0.0.3:5600", 3, "tcp://10.0.0.3:5603"),
    ("tcp://[::1]:5600", 1, "tcp://[::1]:5601"),
    ("tcp://127.0.0.1:0", 1, "tcp://127.0.0.1:0"),  # ephemeral: each rank draws its own
    ("ipc:///run/kvcr/events", 1, "ipc:///run/kvcr/events-dp1"),
    ("", 1, ""),
])
def test_each_rank_binds_the_base_endpoint_offset_by_its_rank(endpoint, rank, expected):
    assert rank_endpoint("events.endpoint", endpoint, rank, 4) == expected


@pytest.mark.parametrize("rank", [0, 1])
def test_a_port_range_past_65535_is_refused_on_every_rank_naming_the_key(rank):
    with pytest.raises(ConfigError, match=r"runner.control_endpoint = 'tcp://127.0.0.1:65535'.*65535..65536.*65534"):
        for_rank(load_config(None, {"runner.control_endpoint": "tcp://127.0.0.1:65535"}), rank, 2)


def test_two_keys_whose_rank_ranges_meet_are_refused_by_name():
    base = load_config(None, {"events.endpoint": "tcp://127.0.0.1:5557",
                              "events.replay_endpoint": "tcp://127.0.0.1:5558"})
    assert for_rank(base, 0, 1).events.replay_endpoint == "tcp://127.0.0.1:5558"  # one rank: no range
    with pytest.raises(ConfigError, match=r"events.endpoint \(port 5557\) and events.replay_endpoint \(port 5558\)"):
        for_rank(base, 1, 2)


def test_a_ranks_config_offsets_every_fixed_port_and_keeps_its_state_apart():
    base = load_config(None, {"runner.control_endpoint": "tcp://127.0.0.1:5600", "runner.http_port": 9090,
                              "events.endpoint": "tcp://127.0.0.1:5700", "events.replay_endpoint": "tcp://127.0.0.1:0",
                              "events.engine_endpoint": "ipc:///tmp/engine", "runner.state_dir": "/var/kvcr",
                              "nvme.storage_dir": "/nvme/kvcr"})
    one = for_rank(base, 1, 2)
    assert (one.runner.dp_rank, one.runner.dp_size) == (1, 2)
    assert (one.runner.control_endpoint, one.runner.http_port) == ("tcp://127.0.0.1:5601", 9091)
    assert (one.events.endpoint, one.events.replay_endpoint) == ("tcp://127.0.0.1:5701", "tcp://127.0.0.1:0")
    assert one.events.engine_endpoint == "ipc:///tmp/engine-dp1"
    assert (one.runner.state_dir, one.nvme.storage_dir) == ("/var/kvcr/dp1", "/nvme/kvcr/dp1")
    alone = for_rank(base, 0, 1)
    assert (alone.runner.state_dir, alone.nvme.storage_dir, alone.runner.http_port) == ("/var/kvcr", "/nvme/kvcr", 9090)


@pytest.mark.parametrize("rank,size", [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_the_group_is_refused(rank, size):
    with pytest.raises(ConfigError, match="need 0 <= rank < size"):
        for_rank(load_config(), rank, size)


@pytest.mark.parametrize("endpoint,expected", [
    ("tcp://0.0.0.0:5601", "tcp://10.1.2.3:5601"),
    ("tcp://*:5601", "tcp://10.1.2.3:5601"),
    ("http://0.0.0.0:9090", "http://10.1.2.3:9090"),
    ("tcp://[::]:5601", "tcp://10.1.2.3:5601"),
    ("tcp://192.0.2.7:5601", "tcp://192.0.2.7:5601"),
    ("ipc:///run/x", "ipc:///run/x"),
])
def test_a_wildcard_bind_is_published_with_the_advertised_host(endpoint, expected):
    assert advertised(endpoint, "10.1.2.3") == expected


def test_an_ipv6_advertised_host_is_published_in_brackets():
    assert advertised("http://0.0.0.0:9090", "fd00::1") == "http://[fd00::1]:9090"
    assert advertised("tcp://*:5600", "[fd00::1]") == "tcp://[fd00::1]:5600"
