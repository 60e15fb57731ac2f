"""Live: DP attention (`--tp 2 --dp-size 2 --enable-dp-attention`, a tiny DeepSeek-V2, the
DP-attention model family SGLang serves; its Llama has no DP-attention path). Each DP rank's
scheduler runs its own runner at the extra-config's base ports + its rank, and every rank is a
peer: a page one rank computed serves the other rank and another worker, and each rank's events
reach `kvcr router` under its own (worker, rank), which routes to the rank holding a prefix."""

from __future__ import annotations

import json

import pytest

from kvcr.client import fetch_info
from kvcr.demo.httpc import http
from sglang_adapter.cpu_harness.model import prompt_text
from tests.helpers import wait_until
from tests.sglang_live.helpers import DP_ATTENTION, followed_blocks, kvcr_router, metric

pytestmark = [pytest.mark.live_sglang, pytest.mark.sglang_dp]
PAGE = 16


@pytest.fixture(scope="module")
def dp_engines(engines, mla_model, tmp_path_factory):
    """Two DP-attention engines (A, B) sharing a peers directory: four runners that follow each other."""
    peers = tmp_path_factory.mktemp("dp-peers")
    return engines("dp-A", "dp-B", model=mla_model, args=DP_ATTENTION, peers_dir=str(peers),
                   env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})


def test_each_rank_runs_its_own_runner_at_the_base_ports_plus_its_rank(dp_engines):
    a, _ = dp_engines
    infos = [fetch_info(a.rank(r)["http"]) for r in (0, 1)]
    assert [i["dp_rank"] for i in infos] == [0, 1]
    assert [i["endpoints"]["control"] for i in infos] == [a.rank(0)["control"], a.rank(1)["control"]]
    # one rank's info finds every rank: how a router discovers the whole engine from one place
    assert infos[0]["dp_ranks"] == infos[1]["dp_ranks"] == {"0": a.rank(0)["http"], "1": a.rank(1)["http"]}


def test_a_ranks_pages_serve_the_other_rank_and_another_worker_as_a_cold_computation(dp_engines, live):
    a, b = dp_engines
    text = prompt_text(700, 400)
    cold = live.on_rank(a, 0, text)
    full = cold["meta_info"]["prompt_tokens"] // PAGE
    wait_until(lambda: len(live.rank_stored(a, 0)) >= full, timeout_s=30, message="rank 0 backed the prompt up")
    for server, rank in ((a, 1), (b, 1)):
        wait_until(lambda: followed_blocks(live.rank_metrics(server, rank), a.rank(0)["control"]) >= full,
                   timeout_s=30, message=f"{server.name} rank {rank} follows A rank 0's stream")
        pulled = live.on_rank(server, rank, text)  # no hint: the rank finds the pages among its peers
        assert pulled["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE, (server.name, rank)
        assert pulled["output_ids"] == cold["output_ids"]
        assert live.logprobs(pulled) == live.logprobs(cold)
        # the pulled pages are the rank's own now (kept just after the read that delivered them)
        wait_until(lambda: len(live.rank_stored(server, rank)) >= full, timeout_s=10,
                   message=f"{server.name} rank {rank} kept the pulled pages")
    assert not live.rank_stored(b, 0) & live.rank_stored(a, 0)  # B's rank 0 never saw the prompt
    wait_until(lambda: metric(live.rank_metrics(a, 0), "kvcr_claims_held") == 0, timeout_s=10,
               message="A rank 0's claims back")


def test_each_ranks_events_reach_the_router_under_its_rank_and_a_prefix_is_routed_to_its_rank(
        dp_engines, mla_model, tmp_path_factory, live):
    a, b = dp_engines
    # one entry per engine, naming rank 0's runner: the router finds rank 1 through its info
    front = kvcr_router(tmp_path_factory.mktemp("dp-router"), mla_model, [
        {"name": s.name, "url": s.url, "runner": s.rank(0)["http"], "engine": "sglang"} for s in (a, b)])
    try:
        status, _, raw = http(front.url + "/workers")
        assert status == 200, raw
        assert sorted((w["name"], w["dp_rank"]) for w in json.loads(raw)) == \
            [("dp-A", 0), ("dp-A", 1), ("dp-B", 0), ("dp-B", 1)]
        text = prompt_text(710, 400)
        first = live.on_rank(a, 1, text)
        full = first["meta_info"]["prompt_tokens"] // PAGE
        body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                "return_logprob": True}

        def indexed() -> dict | None:
            status, _, raw = http(f"{front.url}/debug/index?route=generate", body)
            assert status == 200, raw
            rows = {(row["worker"], row["dp_rank"]): sum(row["overlap"].values()) for row in json.loads(raw)["workers"]}
            return rows if rows[("dp-A", 1)] >= full else None
        rows = wait_until(indexed, timeout_s=30, message="A rank 1's blocks in the router's index")
        assert rows[("dp-A", 0)] == rows[("dp-B", 0)] == 0  # under A's rank 1 only, not its rank 0

        status, headers, raw = http(front.url + "/generate", body)
        assert status == 200, raw
        assert (headers["X-KVCR-Worker"], headers["X-KVCR-DP-Rank"]) == ("dp-A", "1")
        routed = json.loads(raw)
        assert routed["meta_info"]["cached_tokens_details"]["device"] >= full * PAGE  # rank 1's own device pages
        assert live.logprobs(routed) == live.logprobs(first)
    finally:
        front.stop()
