"""The reference router in front of real `kvcr worker` processes (torch model, runner, UCX pulls)."""

import asyncio
import json
import socket
import time

import pytest

from router_hints.http.config import RouterConfigError, parse_router_config
from router_hints.http.front import strip_client_hints
from tests.cluster import http, router, worker
from tests.helpers import wait_until

PROMPT = "Every inference worker keeps KV pages in a local DRAM pool and an NVMe tier. " * 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    workers = [worker(tmp, f"w{i}").start() for i in range(2)]
    try:
        for w in workers:
            w.wait_ready()
        front = router(tmp, workers).start()
        front.wait_ready()
        yield front, workers
    finally:
        for p in [*workers, *([front] if "front" in locals() else [])]:
            p.stop()


def generate(url: str, text: str, headers: dict | None = None, **extra) -> tuple[str | None, dict]:
    status, hdrs, body = http(url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 6}, **extra},
                              headers)
    assert status == 200, body
    return hdrs.get("X-KVCR-Worker"), json.loads(body)


def claims_held(w) -> float:
    _, _, body = http(w.url + "/metrics")
    return next(float(line.split()[-1]) for line in body.decode().splitlines()
                if line.startswith("kvcr_claims_held "))


def dynamo_cost(model: dict, row: dict, request_blocks: int) -> float:
    """Dynamo's cost with the worker's tier weights (configured or measured) and credit for what a
    peer would hand it, recomputed here from the formula (not from router_hints.scoring)."""
    o, load, w = row["overlap"], row["load"], row["weights"]
    credit = (w["device"] * o["device"] + w["host"] * o["host"] + w["dram"] * o["dram"] + w["disk"] * o["disk"]
              + w["pulled"] * row["pullable"])
    return (model["prefill_load_scale"] * max(0.0, load["active_prefill_blocks"] + request_blocks - credit)
            + load["potential_decode_blocks"] + model["decode_active_request_weight"] * load["active_requests"])


def test_a_streamed_chat_through_the_router_returns_the_bytes_of_a_direct_request(cluster):
    front, workers = cluster
    body = {"messages": [{"role": "system", "content": "You route KV."}, {"role": "user", "content": PROMPT}],
            "max_tokens": 8, "stream": True, "rid": "same-request"}
    for _ in range(3):  # `created` is whole seconds: a second boundary between the calls is retried
        status, hdrs, routed = http(front.url + "/v1/chat/completions", body)
        assert status == 200 and hdrs["Content-Type"].startswith("text/event-stream")
        target = next(w for w in workers if w.info["kvcr_runner"]["name"] == hdrs["X-KVCR-Worker"])
        _, _, direct = http(target.url + "/v1/chat/completions", body)
        if routed == direct:
            break
    assert routed == direct
    assert routed.endswith(b"data: [DONE]\n\n") and routed.count(b"data: ") == 10  # role, 8 tokens, DONE
    assert b'"delta": {"role": "assistant"' in routed.split(b"\n\n")[0]


def test_the_target_is_the_cost_minimum_recomputed_from_debug_index(cluster):
    front, workers = cluster
    text = "A prefix that only the second worker holds, long enough for several pages. " * 4
    generate(workers[1].url, text)  # w1 stores it and announces the pages
    view = wait_until(lambda: (v := json.loads(http(front.url + "/debug/index", {"text": text})[2]))
                      ["workers"][1]["overlap"]["dram"] > 0 and v, 10, 0.05, "router indexed w1's pages")
    costs = {row["worker"]: dynamo_cost(view["cost_model"], row, view["request_blocks"]) for row in view["workers"]}
    assert view["workers"][0]["pullable"] == view["workers"][1]["runner"]  # w0 would pull what w1 holds
    assert costs == pytest.approx({row["worker"]: row["cost"] for row in view["workers"]})
    best = min(costs, key=lambda w: (costs[w], w))
    assert best == "w1" and costs["w1"] < costs["w0"]
    worker_name, out = generate(front.url, text)
    assert worker_name == view["choice"]["worker"] == best
    assert out["meta_info"]["kvcr"]["dram_pages"] == view["workers"][1]["overlap"]["dram"] == \
        view["workers"][1]["runner"]


def test_a_worker_without_the_prefix_pulls_it_from_the_peer_the_hint_names(cluster):
    front, workers = cluster
    text = "Pages the first worker computes and the second pulls over UCX on the router's hint. " * 5
    _, cold = generate(workers[0].url, text)
    wait_until(lambda: json.loads(http(front.url + "/debug/index", {"text": text})[2])["workers"][0]["runner"] > 0,
               10, 0.05, "router indexed w0's runner pages")
    name, out = generate(front.url, text, headers={"X-KVCR-Target": "w1"}, kvcr_oracle=True)
    kv = out["meta_info"]["kvcr"]
    assert name == "w1" and kv["peer_pages"] == cold["meta_info"]["kvcr"]["stored_pages"] > 0
    assert kv["source"] == workers[0].info["kvcr_runner"]["endpoints"]["control"]
    assert kv["oracle"]["chunked_equal"] and kv["oracle"]["ok"]
    assert out["output_ids"] == cold["output_ids"]
    assert claims_held(workers[0]) == 0
    metrics = http(front.url + "/metrics")[2].decode()
    assert 'kvcr_router_hints_total{outcome="posted"}' in metrics
    assert 'kvcr_router_decisions_total{route="generate",worker="w1"}' in metrics


def test_a_tenants_pages_serve_only_its_own_salt_locally_and_from_a_peer(cluster):
    """`cache_salt` keys and announces a kvcr worker's pages as SGLang's do: another salt (or none)
    finds nothing in the worker's tiers or the router's index; the same salt pulls on the hint."""
    front, (w0, w1) = cluster
    text = "Pages one tenant computes and nobody else may be served, from a cache or a peer. " * 5
    _, cold = generate(w0.url, text, cache_salt="tenant-a", kvcr_oracle=True)
    held = cold["meta_info"]["kvcr"]["stored_pages"]
    wait_until(lambda: json.loads(http(front.url + "/debug/index", {"text": text, "cache_salt": "tenant-a"})[2])
               ["workers"][0]["runner"] == held, 10, 0.05, "router indexed w0's tenant-a pages")
    for other in ({}, {"cache_salt": "tenant-b"}):
        view = json.loads(http(front.url + "/debug/index", {"text": text, **other})[2])
        assert sum(view["workers"][0]["overlap"].values()) == view["workers"][0]["runner"] == 0, other
        assert view["hint"] is None, other
        _, local = generate(w0.url, text, **other)
        assert local["meta_info"]["kvcr"]["dram_pages"] == 0, other
    name, out = generate(front.url, text, headers={"X-KVCR-Target": "w1"}, cache_salt="tenant-a", kvcr_oracle=True)
    kv = out["meta_info"]["kvcr"]
    assert name == "w1" and kv["peer_pages"] == held and kv["oracle"]["ok"]
    assert out["output_ids"] == cold["output_ids"]


def test_a_hint_a_client_supplies_is_stripped_before_the_worker_sees_it(cluster):
    front, workers = cluster
    bogus = {"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch", "action_version": "1.0", "payload": {
        "source_control_endpoint": "tcp://192.0.2.1:1", "block_hashes": [1, 2, 3]}}]}
    _, out = generate(front.url, "Text no worker has seen before, with a hint of the client's own. " * 3,
                      kv_hints=bogus, kv_transfer_params={"kv_hint": bogus, "other": 1})
    assert out["meta_info"]["kvcr"]["source"] is None
    assert "kvcr_router_client_hints_stripped_total 2.0" in http(front.url + "/metrics")[2].decode()
    clean, removed = strip_client_hints({"text": "x", "sampling_params": {"extra_args": {"kv_transfer_params": {
        "kv_hint": bogus}}}})
    assert removed == 1 and clean["sampling_params"]["extra_args"]["kv_transfer_params"] == {}


@pytest.mark.parametrize("body, problem", [
    (b"{not json", "not JSON"),
    ({"sampling_params": {"max_new_tokens": 4}}, "text must be a string"),
    ({"input_ids": [1, -2]}, "input_ids must be a non-empty list of non-negative integers"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be an integer"),
    ({"text": "hi", "lora_path": "adapter-x"}, "this worker serves no LoRA adapters"),
])
def test_a_bad_request_is_refused_with_the_field_named(cluster, body, problem):
    front, workers = cluster
    for url in (front.url, workers[0].url):
        status, _, out = http(url + "/generate", body)
        assert status == 400 and problem in json.loads(out)["error"]["message"]


def test_a_worker_refuses_a_malformed_hint_with_the_reason(cluster):
    _, workers = cluster
    status, _, out = http(workers[0].url + "/generate", {"text": "hello", "kv_hints": {"actions": [{
        "action_type": "kv.fetch", "payload": {"source_control_endpoint": "tcp://x:1", "block_hashes": [-1]}}]}})
    assert status == 400 and "block_hashes entries must be integers in [0, 2^64)" in json.loads(out)["error"]["message"]


def test_an_openai_completion_and_a_pinned_unknown_worker(cluster):
    front, _ = cluster
    status, _, out = http(front.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    body = json.loads(out)
    assert status == 200 and body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 3
    status, _, out = http(front.url + "/generate", {"text": "x"}, headers={"X-KVCR-Target": "nope"})
    assert status == 400 and "X-KVCR-Target names no worker" in json.loads(out)["error"]["message"]


def test_the_router_learns_a_runners_existing_pages_from_its_snapshot(cluster, tmp_path):
    front, workers = cluster
    text = "Stored before the second router started: it must learn them from the snapshot. " * 3
    generate(workers[0].url, text)
    late = router(tmp_path, workers, name="late").start()
    try:
        late.wait_ready()
        view = json.loads(http(late.url + "/debug/index", {"text": text})[2])
        assert view["workers"][0]["overlap"]["dram"] == view["workers"][0]["runner"] == view["request_blocks"] > 0
    finally:
        late.stop()


@pytest.mark.parametrize("raw, problem", [
    ({"workers": []}, "workers must list at least one worker"),
    ({"workers": [{"url": "http://h:1"}]}, "workers[0].name is required"),
    ({"workers": [{"name": "a", "url": "tcp://h:1"}]}, "workers[0].url = 'tcp://h:1' must be an http:// URL"),
    ({"router": {"port": "80"}, "workers": [{"name": "a", "url": "http://h:1"}]}, "router.port must be int"),
    ({"cost": {"host_weight": 1}, "workers": [{"name": "a", "url": "http://h:1"}]},
     "cost.host_weight is not a known key"),
    ({"workers": [{"name": "a", "url": "http://h:1", "engine": "vllm"}]}, "workers[0].engine = 'vllm' must be one"),
    ({"workers": [{"name": "a", "url": "http://h:1", "engine": "sglang"}]}, "workers[0].runner is required"),
])
def test_a_bad_router_config_is_refused_with_the_key_named(raw, problem):
    with pytest.raises(RouterConfigError, match=problem.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        parse_router_config(raw)


@pytest.mark.parametrize("key, default", [("host_cache_hit_weight", 0.75), ("runner_dram_hit_weight", 0.5),
                                          ("disk_cache_hit_weight", 0.25)])
def test_each_tier_weight_defaults_reads_an_int_as_a_float_and_refuses_a_string_by_name(key, default):
    workers = [{"name": "a", "url": "http://h:1"}]
    assert getattr(parse_router_config({"workers": workers}).cost, key) == default
    assert getattr(parse_router_config({"cost": {key: 1}, "workers": workers}).cost, key) == 1.0
    with pytest.raises(RouterConfigError, match=f"cost.{key} must be float"):
        parse_router_config({"cost": {key: "0.5"}, "workers": workers})


def test_costs_are_measured_by_default_and_can_be_left_to_the_configured_weights():
    workers = [{"name": "a", "url": "http://h:1"}]
    assert parse_router_config({"workers": workers}).measure_costs is True
    assert parse_router_config({"cost": {"measured": False}, "workers": workers}).measure_costs is False
    with pytest.raises(RouterConfigError, match="cost.measured must be bool"):
        parse_router_config({"cost": {"measured": "yes"}, "workers": workers})


def cost_samples(url: str) -> float:
    text = http(url + "/metrics")[2].decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvcr_router_cost_samples_total{"))


def test_each_streamed_answers_first_byte_is_a_cost_sample_and_the_weights_are_exported(cluster):
    front, _ = cluster
    before = cost_samples(front.url)
    for i in range(3):
        status, _, body = http(front.url + "/generate", {"text": f"{i} {PROMPT}", "stream": True,
                                                         "sampling_params": {"max_new_tokens": 4}})
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    generate(front.url, PROMPT)  # not streamed: its first byte is its whole answer, no sample
    assert cost_samples(front.url) == before + 3
    metrics = http(front.url + "/metrics")[2].decode()
    assert 'kvcr_router_tier_weight{dp_rank="0",source="configured",tier="host",worker=' in metrics


def test_a_posted_hint_reaches_a_worker_that_gets_no_hint_in_its_body(cluster, tmp_path):
    """Stock SGLang drops request hints before storage: the router's post to the runner carries it."""
    front, workers = cluster
    text = "Only the posted hint tells the second worker where these pages are. " * 4
    generate(workers[0].url, text)
    no_attach = router(tmp_path, workers, name="post-only", attach_hints=False).start()
    try:
        no_attach.wait_ready()
        name, out = generate(no_attach.url, text, headers={"X-KVCR-Target": "w1"})
        assert name == "w1" and out["meta_info"]["kvcr"]["peer_pages"] > 0
    finally:
        no_attach.stop()


class BrokenEngine:
    """A recording stub (the one fake here): an engine that answers badly, which no real worker
    does on purpose. `mode` picks the failure ("answer": a fixed good answer, where only what the
    router forwarded is under test); `bodies` records what the router forwarded."""

    def __init__(self, mode: str) -> None:
        import http.server
        import threading

        outer = self
        self.bodies: list[dict] = []
        self.closed = threading.Event()  # "endless": the router closed the stream

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                if self.path.startswith("/flush_cache"):  # as SGLang answers while requests run
                    text = b"Flush cache failed: requests are running.\n"
                    self.send_response(400)
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                    return
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                if mode == "refuse":
                    self.send_response(503)
                    self.send_header("Content-Length", "4")
                    self.end_headers()
                    self.wfile.write(b"busy")
                elif mode == "answer":
                    text = b'{"text": "ok", "meta_info": {}}'
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                elif mode == "silent":  # takes the request and answers nothing
                    outer.closed.wait(30)
                elif mode == "endless":  # streams until the router closes the connection
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    event = b'data: {"text": "x"}\n\n'
                    try:
                        while True:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                            self.wfile.flush()
                            time.sleep(0.01)
                    except OSError:
                        outer.closed.set()
                else:  # "cut": a promised body of 1000 bytes stops after 19: the connection drops
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b'data: {"text": "par')
                    self.wfile.flush()
                    self.connection.shutdown(2)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.mark.parametrize("mode, status", [("refuse", 503), ("cut", 200)])
def test_a_failing_engine_is_passed_through_or_cut_never_answered_twice(runner_factory, tmp_path, mode, status):
    runner = runner_factory("stubbed", **{"runner.block_size": 16})
    info = runner.start()
    engine = BrokenEngine(mode)
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"router": {"port": 0}, "workers": [
        {"name": "s", "url": engine.url, "runner": info["endpoints"]["http"], "engine": "sglang"}]}))
    from tests.cluster import Child

    front = Child(tmp_path, "router-stub", ["router", "--config", str(cfg)]).start()
    try:
        front.wait_ready()
        code, _, body = http(front.url + "/generate", {"text": "hello there", "stream": True})
        assert code == status
        # A refusal goes to the next worker; with none left, the client gets the worker's own answer.
        assert body == (b"busy" if mode == "refuse" else b'data: {"text": "par')  # nothing appended
        assert len(engine.bodies) == 1 and "kv_hints" not in engine.bodies[0]  # sent once: no other worker
        metrics = http(front.url + "/metrics")[2].decode()
        assert 'kvcr_router_upstream_errors_total{worker="s"} 1.0' in metrics
    finally:
        front.stop()
        engine.close()


def test_a_dp_engine_named_by_one_ranks_runner_is_routed_per_rank_with_the_rank_in_the_body(runner_factory,
                                                                                              tmp_path):
    """The runners of an engine's two DP ranks (one config: base ports + rank); the router, given rank 0's,
    follows both as (worker, rank) and tells the engine which rank runs each request."""
    from sglang_adapter.cpu_harness.server import free_port
    from tests.cluster import Child

    control, http_port = free_port(2), free_port(2)
    group = {"runner.block_size": 16, "runner.dp_size": 2, "runner.control_endpoint": f"tcp://127.0.0.1:{control}",
             "runner.http_port": http_port}
    infos = [runner_factory(f"dp{rank}", **group, **{"runner.dp_rank": rank}).start() for rank in (0, 1)]
    engine = BrokenEngine("answer")
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"router": {"port": 0}, "workers": [
        {"name": "dp", "url": engine.url, "runner": infos[0]["endpoints"]["http"], "engine": "sglang"}]}))
    front = Child(tmp_path, "router-dp", ["router", "--config", str(cfg)]).start()
    try:
        front.wait_ready()
        workers = json.loads(http(front.url + "/workers")[2])
        assert sorted((w["name"], w["dp_rank"]) for w in workers) == [("dp", 0), ("dp", 1)]
        for i in range(4):  # a client's own rank is the router's to choose
            status, headers, _ = http(front.url + "/generate", {"text": f"{i} {PROMPT}", "routed_dp_rank": 7,
                                                                "data_parallel_rank": 7})
            assert status == 200
            sent = engine.bodies[-1]
            assert sent["routed_dp_rank"] == int(headers["X-KVCR-DP-Rank"]) in (0, 1)
            assert "data_parallel_rank" not in sent
    finally:
        front.stop()
        engine.close()


def test_a_worker_silent_past_the_request_timeout_is_not_retried_elsewhere(runner_factory, tmp_path):
    # It may be a long generation: running it again would make the client wait that long again.
    from tests.cluster import Child

    engines = [BrokenEngine("silent"), BrokenEngine("silent")]
    runners = [runner_factory(f"stubbed{i}", **{"runner.block_size": 16}).start() for i in range(2)]
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"router": {"port": 0, "request_timeout_s": 1.0}, "workers": [
        {"name": f"slow{i}", "url": e.url, "runner": r["endpoints"]["http"], "engine": "sglang"}
        for i, (e, r) in enumerate(zip(engines, runners))]}))
    front = Child(tmp_path, "router-silent", ["router", "--config", str(cfg)]).start()
    try:
        front.wait_ready()
        status, _, body = http(front.url + "/generate", {"text": "hello there"})
        assert status == 504 and b"sent nothing within 1 s" in body
        assert sum(len(e.bodies) for e in engines) == 1  # the other worker never got it
    finally:
        for e in engines:
            e.closed.set()
        front.stop()
        for e in engines:
            e.close()


def test_flush_cache_answers_400_as_sglang_does_when_a_worker_still_runs_requests(runner_factory, tmp_path, cluster):
    from tests.cluster import Child

    info = runner_factory("stubbed", **{"runner.block_size": 16}).start()
    engine = BrokenEngine("refuse")
    _, workers = cluster
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"router": {"port": 0}, "workers": [
        {"name": "busy", "url": engine.url, "runner": info["endpoints"]["http"], "engine": "sglang"},
        {"name": workers[0].info["kvcr_runner"]["name"], "url": workers[0].url}]}))
    front = Child(tmp_path, "router-flush", ["router", "--config", str(cfg)]).start()
    try:
        front.wait_ready()
        status, _, body = http(front.url + "/flush_cache", {})
        assert status == 400 and b"busy: 400 Flush cache failed: requests are running." in body
        assert b"w0: 200 Cache flushed" in body  # the other worker flushed
    finally:
        front.stop()
        engine.close()


def test_a_client_that_leaves_mid_stream_is_no_worker_failure_and_the_worker_is_let_go(runner_factory, tmp_path):
    """Seen live in front of SGLang: a client closing a stream made the router log a server error
    (and aiohttp's ClientConnectionResetError counted as the worker's failure)."""
    info = runner_factory("stubbed", **{"runner.block_size": 16}).start()
    engine = BrokenEngine("endless")
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"router": {"port": 0}, "workers": [
        {"name": "s", "url": engine.url, "runner": info["endpoints"]["http"], "engine": "sglang"}]}))
    from tests.cluster import Child

    front = Child(tmp_path, "router-left", ["router", "--config", str(cfg)]).start()
    try:
        front.wait_ready()
        host, port = front.url.removeprefix("http://").split(":")
        body = json.dumps({"text": "hello there", "stream": True}).encode()
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_until(lambda: b"data: " in client.recv(65536), 10, 0.01, "the stream started")
        assert engine.closed.wait(10), "the router kept the worker's stream open after its client left"
        wait_until(lambda: json.loads(http(front.url + "/workers")[2])[0]["load"]["active_requests"] == 0, 10,
                   0.05, "the request's load released")
        metrics = http(front.url + "/metrics")[2].decode()
        assert "kvcr_router_upstream_errors_total{" not in metrics
        assert "Error handling request" not in front.log_path.read_text()
    finally:
        front.stop()
        engine.close()


def test_a_salted_request_is_matched_in_its_own_cache_namespace(tmp_path):
    """SGLang announces a salted request's pages with its `cache_salt`; the router must hash the
    request under the body's `cache_salt` to find them (and not match another namespace's)."""
    from aiohttp.test_utils import TestClient, TestServer

    from kvcr.proto.announce import announce_request
    from kvcr.proto.events import EventBatch
    from kvcr.proto.pool import coalesce_announces
    from router_hints.discovery import Publisher
    from router_hints.http.server import Router

    cfg = parse_router_config({"workers": [{"name": n, "url": f"http://127.0.0.1:{i + 1}"}
                                           for i, n in enumerate(("w0", "w1"))]})
    router = Router(cfg)
    for entry in cfg.workers:  # publishers nobody serves: the index is fed below
        router.core.add(Publisher(entry.name, 0, 16, "tcp://127.0.0.1:9", None, f"tcp://{entry.name}.invalid:1"))
        router.fleet.entries[(entry.name, 0)] = entry
    text = PROMPT * 2
    tokens = router.tokenizer.encode(text)
    (event,) = coalesce_announces(announce_request(tokens, 16, cache_salt="tenant-a"), 16, "CPU_TIER1")
    router.core.index.apply("w1", EventBatch(ts=0.0, events=(event,), dp_rank=0))

    async def views() -> list:
        async with TestClient(TestServer(router.app())) as client:
            out = []
            for extra in ({"cache_salt": "tenant-a"}, {}, {"cache_salt": ""}, {"cache_salt": "tenant-b"},
                          {"cache_salt": ["tenant-a"]}):
                resp = await client.post("/debug/index", json={"text": text, **extra})
                out.append((resp.status, await resp.json()))
            resp = await client.post("/generate", json={"text": text, "cache_salt": 7})
            out.append((resp.status, await resp.json()))
            return out

    try:
        (s1, salted), *unsalted, (s5, listed), (s6, generated) = asyncio.run(views())
    finally:
        asyncio.run(router.close())
    assert s1 == 200 and salted["workers"][1]["overlap"] == {"device": 0, "host": 0, "dram": len(tokens) // 16,
                                                              "disk": 0}
    assert salted["workers"][1]["runner"] == salted["request_blocks"] == len(tokens) // 16
    assert salted["choice"]["worker"] == "w1"
    for status, view in unsalted:  # no salt, "" (none, as in SGLang), another salt: nothing held
        assert status == 200 and all(sum(row["overlap"].values()) == row["runner"] == 0 for row in view["workers"])
    assert s5 == 400 and "cache_salt must be a string" in listed["error"]["message"]
    assert s6 == 400 and "cache_salt must be a string" in generated["error"]["message"]


OPERATOR = "operator-token-for-tests"


@pytest.mark.parametrize("router_keys, headers, status", [
    ({}, {}, 200),                                                    # loopback, no token: the local operator
    ({"host": "0.0.0.0"}, {}, 403),                                   # reachable from other hosts: needs a token
    ({"operator_token": OPERATOR}, {}, 403),
    ({"operator_token": OPERATOR}, {"Authorization": "Bearer nope"}, 403),
    ({"operator_token": OPERATOR}, {"Authorization": f"Bearer {OPERATOR}"}, 200),
])
def test_pinning_a_worker_and_the_index_view_need_the_operator(router_keys, headers, status):
    from aiohttp.test_utils import TestClient, TestServer

    from router_hints.discovery import Publisher
    from router_hints.http.server import Router

    cfg = parse_router_config({"router": router_keys, "workers": [{"name": "w0", "url": "http://127.0.0.1:1"}]})
    router = Router(cfg)
    router.core.add(Publisher("w0", 0, 16, "tcp://127.0.0.1:9", None, None))  # nobody serves it: not needed
    router.fleet.entries[("w0", 0)] = cfg.workers[0]

    async def ask() -> list:
        async with TestClient(TestServer(router.app())) as client:
            index = await client.post("/debug/index", json={"text": "x"}, headers=headers)
            pinned = await client.post("/generate", json={"text": "x"}, headers={**headers, "X-KVCR-Target": "nope"})
            return [(index.status, await index.json()), (pinned.status, await pinned.json())]

    try:
        (s_index, index), (s_pinned, pinned) = asyncio.run(ask())
    finally:
        asyncio.run(router.close())
    assert s_index == status and (status == 200 or "operator" in index["error"]["message"])
    # Allowed, the pin is judged on its merits (no such worker); refused, it never reaches routing.
    assert (s_pinned, "names no worker" in pinned["error"]["message"]) == ((400, True) if status == 200 else (403, False))


@pytest.mark.parametrize("events, expected", [
    ([("heard", "a", 0.5), ("expire", None, 1.9)], {"dead": set(), "revived": []}),
    ([("expire", None, 2.0)], {"dead": {"a", "b"}, "revived": []}),
    ([("heard", "a", 1.0), ("expire", None, 2.5)], {"dead": {"b"}, "revived": []}),
    ([("expire", None, 2.0), ("heard", "b", 2.1)], {"dead": {"a"}, "revived": ["b"]}),
    ([("forget", "a", 0.0), ("expire", None, 9.0)], {"dead": {"b"}, "revived": []}),
])
def test_a_worker_is_dead_once_its_stream_is_silent_for_dead_after_s_and_revived_by_a_batch(events, expected):
    from router_hints.liveness import Liveness

    live = Liveness(dead_after_s=2.0)
    for w in ("a", "b"):
        live.watch((w, 0), now=0.0)
    revived = []
    for kind, name, now in events:
        if kind == "heard" and live.heard((name, 0), now):
            revived.append(name)
        elif kind == "expire":
            live.expire(now)
        elif kind == "forget":
            live.forget((name, 0))
    assert {w for w, _ in live.dead} == expected["dead"] and revived == expected["revived"]


def routed_pair(tmp_path, workers: list, **router_keys) -> tuple[list, object]:
    """Start `workers`, then a router in front of them; both ready."""
    for w in workers:
        w.start()
    for w in workers:
        w.wait_ready()
    front = router(tmp_path, workers, **router_keys).start()
    front.wait_ready()
    return workers, front


def test_a_silent_worker_is_dropped_from_routing_and_back_when_it_speaks_and_the_operator_edits_membership(tmp_path):
    import signal as sig

    workers, front = routed_pair(tmp_path, [worker(tmp_path, f"m{i}") for i in range(2)], dead_after_s=2.0)
    try:
        text = "Pages only m1 holds: while m1 is silent the router must not send them there. " * 4
        assert generate(front.url, text, headers={"X-KVCR-Target": "m1"})[0] == "m1"
        overlap_at = lambda: {r["worker"]: r["runner"] for r in
                              json.loads(http(front.url + "/debug/index", {"text": text})[2])["workers"]}
        wait_until(lambda: overlap_at().get("m1", 0) > 0, 10, 0.05, "m1's pages indexed")
        alive = lambda: {w["name"]: w["alive"] for w in json.loads(http(front.url + "/workers")[2])}
        workers[1].send_signal(sig.SIGSTOP)  # heartbeats stop; its sockets stay open
        try:
            wait_until(lambda: alive() == {"m0": True, "m1": False}, 2.0 + 5, 0.1, "m1 declared down")
            assert set(overlap_at()) == {"m0"} and generate(front.url, text)[0] == "m0"
            status, _, body = http(front.url + "/generate", {"text": text}, headers={"X-KVCR-Target": "m1"})
            assert status == 503 and "is down" in json.loads(body)["error"]["message"]
        finally:
            workers[1].send_signal(sig.SIGCONT)
        wait_until(lambda: alive() == {"m0": True, "m1": True}, 10, 0.1, "m1 back")
        wait_until(lambda: overlap_at().get("m1", 0) > 0, 10, 0.1, "m1's pages reloaded from its snapshot")
        # The operator takes m1 out, then puts it back, at run time.
        status, _, _ = http(front.url + "/admin/workers/m1", method="DELETE")
        assert status == 200 and alive() == {"m0": True}
        entry = {"name": "m1", "url": workers[1].url}
        assert http(front.url + "/admin/workers", entry)[0] == 200 and alive() == {"m0": True, "m1": True}
        assert http(front.url + "/admin/workers", entry)[0] == 409
        assert http(front.url + "/admin/workers", {"url": workers[1].url})[0] == 400
    finally:
        for p in [front, *workers]:
            p.stop()


def test_workers_join_and_leave_through_info_files_in_the_discovery_directory(tmp_path):
    from kvcr.demo.procs import Child

    directory = tmp_path / "discovery"
    directory.mkdir()
    (tmp_path / "router.json").write_text(json.dumps({"router": {"port": 0, "discovery_dir": str(directory)},
                                                      "workers": []}))
    front = Child(tmp_path, "router", ["router", "--config", str(tmp_path / "router.json")]).start()
    joined = worker(directory, "d0").start()  # its --info-file lands in the directory once it is up
    try:
        front.wait_ready()
        joined.wait_ready()
        names = lambda: [w["name"] for w in json.loads(http(front.url + "/workers")[2])]
        wait_until(lambda: names() == ["d0"], 30, 0.2, "d0 joined from its info file")
        assert generate(front.url, "A worker found through the discovery directory. " * 3)[0] == "d0"
        joined.info_file.unlink()
        wait_until(lambda: names() == [], 10, 0.2, "d0 left once its file went")
    finally:
        for p in (front, joined):
            p.stop()


def dynamo_card(runtime_data: dict) -> dict:
    """A Dynamo model card as etcd holds it (the fields read here; tests/dynamo_live reads real ones)."""
    return {"type": "Model", "card_json": {"runtime_config": {"runtime_data": runtime_data}}}


def test_the_kvcr_workers_among_dynamos_model_cards_become_worker_entries():
    from router_hints.http.dynamo_discovery import entries_from_cards

    entries, problems = entries_from_cards({
        "v1/mdc/kvcr/backend/generate/a": dynamo_card({"router_hint": True, "kvcr_worker": {
            "name": "wa", "url": "http://10.0.0.1:8000"}}),
        "v1/mdc/kvcr/backend/generate/b": dynamo_card({"kvcr_worker": {
            "name": "sb", "url": "http://10.0.0.2:30000", "runner": "http://10.0.0.2:9400", "engine": "sglang"}}),
        "v1/mdc/kvcr/backend/generate/c": dynamo_card({"router_hint": True}),  # a Dynamo worker, not kvcr's
        "v1/mdc/kvcr/backend/generate/d": dynamo_card({"kvcr_worker": {"name": "wd", "url": "ftp://x"}}),
        "v1/mdc/kvcr/backend/generate/e": {"type": "Model"},
    })
    assert {k.rsplit("/", 1)[1]: (e.name, e.url, e.runner, e.engine) for k, e in entries.items()} == {
        "a": ("wa", "http://10.0.0.1:8000", "", "kvcr-worker"),
        "b": ("sb", "http://10.0.0.2:30000", "http://10.0.0.2:9400", "sglang")}
    assert len(problems) == 1 and "generate/d kvcr_worker.url = 'ftp://x' must be an http:// URL" in problems[0]


# --- the surface SGLang's and OpenAI's clients expect --------------------------------------------

@pytest.mark.parametrize("path", ["/v1/models", "/model_info", "/get_model_info"])
def test_what_every_worker_answers_alike_is_answered_by_one_of_them(cluster, path):
    front, workers = cluster
    status, hdrs, routed = http(front.url + path)
    assert status == 200
    direct = http(next(w for w in workers if w.info["kvcr_runner"]["name"] == hdrs["X-KVCR-Worker"]).url + path)[2]
    assert json.loads(routed) == json.loads(direct)


def test_the_model_list_and_server_info_have_the_shapes_sglangs_client_reads(cluster):
    front, workers = cluster
    models = json.loads(http(front.url + "/v1/models")[2])
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    name = models["data"][0]["id"]
    assert json.loads(http(front.url + f"/v1/models/{name}")[2])["id"] == name
    status, _, body = http(front.url + "/v1/models/no-such-model")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    for path in ("/server_info", "/get_server_info"):
        info = json.loads(http(front.url + path)[2])
        assert info["model"] == name and "kvcr_runner" in info


def test_health_and_health_generate_answer_while_a_worker_generates(cluster):
    front, _ = cluster
    assert http(front.url + "/health")[0] == 200
    status, _, body = http(front.url + "/health_generate")
    assert status == 200 and body.decode().count(": 200") == 2


def test_flush_cache_empties_every_workers_cache(cluster):
    front, workers = cluster
    text = "A prompt both workers will hold before the flush empties them. " * 3
    for w in workers:
        generate(w.url, text)
    for w in workers:
        wait_until(lambda: json.loads(http(w.url + "/server_info")[2])["tiers"]["dram_pages"] > 0, 10, 0.05,
                   "pages held")
    status, _, body = http(front.url + "/flush_cache?timeout=30", {})
    assert status == 200 and body.startswith(b"Cache flushed on all 2 workers.")
    for w in workers:
        assert json.loads(http(w.url + "/server_info")[2])["tiers"]["dram_pages"] == 0
    assert http(front.url + "/flush_cache")[0] == 200  # GET, as SGLang also takes it


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_completes_and_chats_through_the_router(cluster, stream):
    import openai

    front, _ = cluster
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, stream=stream)
    chat = client.chat.completions.create(model=model, max_tokens=6, stream=stream,
                                          messages=[{"role": "user", "content": PROMPT}])
    if stream:
        text = "".join(c.choices[0].text for c in completion if c.choices)
        said = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    else:
        assert completion.usage.completion_tokens == 6 and chat.usage.completion_tokens == 6
        text, said = completion.choices[0].text, chat.choices[0].message.content
    assert text and said


def held_by(front, name: str, text: str) -> None:
    """`name` serves `text` (pinned) and the router's index then sends it there."""
    assert generate(front.url, text, headers={"X-KVCR-Target": name})[0] == name
    wait_until(lambda: json.loads(http(front.url + "/debug/index", {"text": text})[2])["choice"]["worker"] == name,
               10, 0.05, f"{name}'s pages indexed")


def test_a_worker_killed_while_requests_flow_costs_no_request_and_is_routed_to_again_once_back(tmp_path):
    import signal as sig

    from kvcr.demo.procs import Child
    from sglang_adapter.cpu_harness.server import free_port

    workers, front = routed_pair(tmp_path, [worker(tmp_path, "k0"), worker(tmp_path, "k1", "--port", str(free_port()))],
                                 health_interval_s=0.2)
    try:
        prefix = "A long shared prefix that only k1 holds, so the router sends this flow to k1. " * 4
        held_by(front, "k1", prefix)
        seen = []
        for i in range(30):
            if i == 5:  # mid-flow, before its event stream is missed: requests routed to it go to k0 instead
                workers[1].proc.send_signal(sig.SIGKILL)
                workers[1].proc.wait(10)
            seen.append(generate(front.url, f"{prefix} Question {i}?")[0])  # asserts 200: no request fails
        assert seen[:5] == ["k1"] * 5 and set(seen[5:]) == {"k0"}
        metrics = http(front.url + "/metrics")[2].decode()
        assert 'kvcr_router_breaker_trips_total{worker="k1"} 1.0' in metrics
        assert not [line for line in metrics.splitlines() if line.startswith("kvcr_router_failed_requests_total{")]
        back = Child(tmp_path, "k1-again", workers[1].args[3:-2]).start()  # same name and port, a new runner
        workers.append(back)
        back.wait_ready()
        alive = lambda: {w["name"]: w["alive"] for w in json.loads(http(front.url + "/workers")[2])}
        failing = lambda: "kvcr_router_workers_failing 0.0" in http(front.url + "/metrics")[2].decode()
        wait_until(lambda: alive() == {"k0": True, "k1": True} and failing(), 30, 0.2, "k1 routed to again")
        text = "Pages only the restarted k1 holds: the router must send this prompt back there. " * 4
        held_by(front, "k1", text)
        assert generate(front.url, text)[0] == "k1"
    finally:
        for p in [front, *workers]:
            p.stop()
