"""`kvcr replay`: trace parsing and the simulation against hand-computed cases."""

import json
import re
import subprocess
import sys

import pytest

from router_hints.replay.caches import BlockLRU
from router_hints.replay.live import simulated_cluster
from router_hints.replay.sim import SimConfig, Simulation, simulate
from router_hints.replay.trace import TraceError, TraceRequest, parse_lines
from tests.helpers import ROOT

BLOCK = 512


def req(t, blocks, length=None, output=0):
    return TraceRequest(t, length if length is not None else len(blocks) * BLOCK, output, tuple(blocks))


@pytest.fixture
def cfg():
    return SimConfig(workers=2, dram_blocks=1000, prefill_tokens_per_s=8000.0)


def test_a_mooncake_line_and_a_token_ids_line_read_into_requests():
    tokens = list(range(3 * 4))
    lines = ['{"timestamp": 1500, "input_length": 7, "output_length": 9, "hash_ids": [3, 4]}', "",
             json.dumps({"timestamp": 0, "token_ids": tokens}), json.dumps({"timestamp": 2, "token_ids": tokens[:8]})]
    a, b, c = list(parse_lines(lines, block_tokens=4))
    assert a == TraceRequest(1.5, 7, 9, (3, 4))
    assert len(b.blocks) == 3 and c.blocks == b.blocks[:2]  # a shared prefix gets the same ids


@pytest.mark.parametrize("line, reason", [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"timestamp": -1, "input_length": 10, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 10}', "hash_ids (Mooncake) or token_ids"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [1, -2]}', "hash_ids must be"),
    ('{"timestamp": 0, "input_length": 2000, "hash_ids": [1, 2]}', "does not fit 2 blocks"),
    ('{"timestamp": 0, "input_length": true, "hash_ids": [1]}', "input_length"),
    ('{"timestamp": 0, "token_ids": [1, "a"]}', "token_ids must be"),
])
def test_a_bad_line_is_refused_with_its_number_and_reason(line, reason):
    lines = ['{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', line]
    with pytest.raises(TraceError, match=f"line 2: .*{re.escape(reason)}"):
        list(parse_lines(lines))


def test_the_ideal_cache_hits_a_repeated_request(cfg):
    r = Simulation(cfg, "ideal").run([req(0, range(10)), req(100, range(10))])
    assert r.reused == {"dram": 10, "nvme": 0, "peer": 0} and r.reuse == 0.5


def test_round_robin_sends_the_repeat_to_the_other_worker_and_misses(cfg):
    r = Simulation(cfg, "round_robin").run([req(0, range(10)), req(100, range(10))])
    assert r.reuse == 0 and r.recomputed_tokens == 20 * BLOCK


def test_kv_aware_routing_sends_the_repeat_to_the_worker_that_holds_it(cfg):
    r = Simulation(cfg, "kv").run([req(0, range(10)), req(100, range(10))])
    assert r.reused["dram"] == 10 and r.prefill_tokens_by_worker == [10 * BLOCK, 0]


def busy_holder_trace():
    """Worker 0 holds A (10 blocks) and is still prefilling it when A + 50 blocks arrives: the
    cost model sends that to idle worker 1 (10 + 60 - 0.75 x 10 > 60)."""
    return [req(0, range(10)), req(0.01, [*range(10), *range(100, 150)])]


def test_kvcr_pulls_from_the_busy_holder_and_the_pull_beats_recomputing(cfg):
    results = simulate(busy_holder_trace(), cfg, ["kv", "kvcr"])
    kv, kvcr = results["kv"], results["kvcr"]
    assert kv.reuse == 0 and kv.prefill_tokens_by_worker == [10 * BLOCK, 60 * BLOCK]
    assert kvcr.reused["peer"] == 10 and kvcr.pulled_blocks == 10 and kvcr.pulls == 1
    pull_s = 0.0005 + 10 * BLOCK * 131072 / 25e9
    assert kv.ttft_s[1] == pytest.approx(60 * BLOCK / 8000)
    assert kvcr.ttft_s[1] == pytest.approx(pull_s + 50 * BLOCK / 8000)
    assert kvcr.ttft_s[1] < kv.ttft_s[1]


def test_a_worker_reuses_what_its_nvme_kept_after_dram_let_it_go():
    cfg = SimConfig(workers=1, dram_blocks=10, nvme_blocks=100)
    r = Simulation(cfg, "kv").run([req(0, range(10)), req(10, range(100, 110)), req(20, range(10))])
    assert r.reused == {"dram": 0, "nvme": 10, "peer": 0}


def test_an_lru_fill_keeps_the_request_head_most_recent_and_evicts_the_oldest():
    lru = BlockLRU(5)
    assert lru.fill([1, 2, 3]) == ([1, 2, 3], [])
    assert lru.fill([4, 5]) == ([4, 5], [])
    assert lru.fill([1, 2, 6]) == ([6], [3])      # 1 and 2 are touched, 3 is the oldest
    assert lru.fill([7, 8]) == ([7, 8], [5, 4])   # 4 and 5 were filled before 6, 2 and 1
    assert lru.fill([1, 9, 2]) == ([9], [6])      # a hole in a held run is filled in place


@pytest.mark.parametrize("policy, indexed", [("round_robin", False), ("ideal", False), ("kv", True), ("kvcr", True)])
def test_only_the_policies_that_route_by_the_index_feed_it(cfg, policy, indexed):
    sim = Simulation(cfg, policy)
    sim.run([req(0, range(10)), req(100, range(20, 30))])
    assert (sim.index.num_blocks() == 20) is indexed and (sim.index.num_blocks() == 0) is not indexed


def test_queueing_delays_a_request_behind_the_one_before_it():
    cfg = SimConfig(workers=1, dram_blocks=100, prefill_tokens_per_s=512.0)
    r = Simulation(cfg, "round_robin").run([req(0, [1, 2]), req(0.5, [3])])
    assert r.ttft_s == [pytest.approx(2.0), pytest.approx(1.5 + 1.0)]


@pytest.mark.parametrize("concurrency, by_worker", [(1, [2, 0]), (8, [1, 1])])
def test_the_simulated_live_cluster_sees_load_only_when_requests_overlap(concurrency, by_worker):
    """Two unrelated requests 1 ms apart: one in flight at a time, the router never sees worker 0
    busy and keeps the lowest id; with more in flight, the first one's prefill is queued load."""
    cfg = simulated_cluster(SimConfig(workers=2), slots=100, page_size=16, concurrency=concurrency)
    r = Simulation(cfg, "kvcr").run([req(0, range(10), 160), req(0.001, range(100, 110), 160)])
    assert r.requests_by_worker == by_worker


def test_replay_writes_json_and_charts_and_refuses_a_bad_trace(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "kvcr.cli", "replay", "--synthetic", "300", "--workers", "4",
                          "--capacity-blocks", "200", "--sweep-capacity", "50,200", "--out", str(out),
                          "--json", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "r.json").read_text())
    for policy in ("round_robin", "kv", "kvcr", "ideal"):
        s = summary["policies"][policy]
        assert {"reuse", "recomputed_tokens", "pulled_blocks", "ttft_p50_s", "ttft_p99_s", "ttft_mean_s"} <= set(s)
    assert summary["policies"]["ideal"]["reuse"] >= summary["policies"]["round_robin"]["reuse"]
    assert (out / "replay.png").stat().st_size > 0 and (out / "replay-capacity.png").stat().st_size > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timestamp": 0}\n')
    run = subprocess.run([sys.executable, "-m", "kvcr.cli", "replay", str(bad), "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "line 2" in run.stderr


@pytest.mark.parametrize("router, engine", [("kvcr", "kvcr"), pytest.param("dynamo", "kvcr", marks=pytest.mark.dynamo_frontend),
                                            pytest.param("kvcr", "sglang", marks=pytest.mark.live_sglang)])
def test_the_live_mode_drives_the_trace_through_the_router_and_workers_and_reports_both(tmp_path, router, engine):
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "kvcr.cli", "replay", "--synthetic", "80", "--workers", "2",
                          "--capacity-blocks", "200", "--live", "--live-requests", "60", "--speedup", "20",
                          "--live-router", router, "--live-engine", engine, "--no-charts", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    live = json.loads((out / "replay.json").read_text())["live"]
    assert live["router"] == router and live["engine"] == engine
    measured = live["measured"]
    assert live["requests"] == 60 and measured["requests"] == 60 and measured["errors"] == 0
    assert sum(measured["requests_by_worker"].values()) == 60  # each response named the worker that served it
    assert measured["reuse"] > 0 and live["simulated"]["reuse"] > 0  # shared system prompts are reused in both
    assert live["pages_per_worker"] >= 200


@pytest.mark.parametrize("flags, problem", [(["--live-engine", "sglang", "--live-router", "dynamo"], "kvcr router only"),
                                            (["--live-concurrency", "0"], "--live-concurrency 0")])
def test_live_options_that_cannot_run_are_refused_by_name(tmp_path, flags, problem):
    run = subprocess.run([sys.executable, "-m", "kvcr.cli", "replay", "--synthetic", "10", "--live", *flags,
                          "--no-charts", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and problem in run.stderr, run.stderr
