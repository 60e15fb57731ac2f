"""Router → hint → pull, end to end with real runners: the flow the product exists for."""

import time

import pytest

from kvcr.client import AttachedWriter, ControlClient
from kvcr.proto import messages as m
from router_hints.core import RouterCore
from router_hints.discovery import DiscoveryError, fetch_runner, from_sglang_server_info
from tests.helpers import wait_until
from tests.pages import BLOCK, pages_for

PAGE = 64 * 1024
POOLS = [{"name": "kv", "page_bytes": PAGE}]


def test_the_router_sends_a_request_to_the_cheapest_worker_with_a_hint_and_the_pull_follows(runner_factory):
    a = runner_factory("a", **{"dram.pools": POOLS})
    b = runner_factory("b", **{"dram.pools": POOLS, "runner.peers": ["*"]})
    ai, bi = a.start(), b.start()
    router = RouterCore(block_size=BLOCK)
    for name, info in (("a", ai), ("b", bi)):
        router.add(fetch_runner(name, info["endpoints"]["http"], block_size=BLOCK))
    time.sleep(1.0)  # slow joiner
    keys, ann, data = pages_for(8, seed=21, page_bytes=PAGE)
    tokens = [t for x in ann for t in x.token_ids]
    with ControlClient(ai["endpoints"]["control"]) as client:
        wait_until(lambda: client.info()["ucx"]["rkeys"], 10, 0.05, "UCX registration")
        writer = AttachedWriter(client)
        writer.put("kv", keys, data, ann)
        writer.close()
    wait_until(lambda: (router.poll(50), router.index.num_blocks() >= 8)[1], 10, 0.05, "router saw A's pages")

    # A holds the prefix in DRAM: with equal load the router picks A, and no hint is needed.
    route = router.route(tokens)
    assert route.choice.worker == ("a", 0) and route.hint is None
    # A is busy: the router picks B and names A as the source of the prefix.
    from router_hints.scoring import Load
    router.loads[("a", 0)] = Load(active_prefill_blocks=100)
    route = router.route(tokens)
    assert route.choice.worker == ("b", 0)
    assert route.hint["actions"][0]["payload"]["source_control_endpoint"] == ai["endpoints"]["control"]
    with ControlClient(bi["endpoints"]["control"], timeout_s=30) as client:
        client.request(m.PostHint(envelope=route.hint))  # stock SGLang does not forward hints: post them
        assert client.request(m.PullRequest(pool="kv", keys=keys)).num_local == 8
        writer = AttachedWriter(client)
        assert writer.get("kv", keys) == data
        writer.close()
    # B announces what it pulled: the router now sees both workers holding the prefix.
    wait_until(lambda: (router.poll(50), len(router.index.overlaps(router.index.sequence_hashes(tokens))) == 2)[1],
               10, 0.05, "router saw B's pulled pages")
    router.close()


def test_a_block_size_mismatch_is_refused_by_name(runner_factory):
    info = runner_factory("a").start()
    with pytest.raises(DiscoveryError, match="runner block_size 16 != router block_size 32"):
        fetch_runner("a", info["endpoints"]["http"], block_size=32)


def test_sglang_publishers_are_found_from_server_info_per_dp_rank():
    info = {"kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "",
                          "block_size": 16, "dp_size": 2, "replay_endpoint_port_base": 5600}}
    pubs = from_sglang_server_info("w", info, "10.0.0.5", block_size=16)
    assert [(p.dp_rank, p.events, p.replay) for p in pubs] == [(0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600"),
                                                                 (1, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5601")]
    with pytest.raises(DiscoveryError, match="engine block_size 16 != router block_size 64"):
        from_sglang_server_info("w", info, "h", block_size=64)
