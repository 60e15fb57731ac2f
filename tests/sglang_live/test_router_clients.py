"""`kvcr router` in front of two live SGLang engines, driven by the clients users already run:
SGLang's own benchmark client (`python -m sglang.benchmark.serving`, no flags for our sake) and
the `openai` client; and an engine SIGKILLed while requests flow, then restarted."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvcr.demo.httpc import http
from sglang_adapter.cpu_harness.model import prompt_text
from sglang_adapter.cpu_harness.server import ROOT, harness_env
from tests.helpers import wait_until
from tests.sglang_live.helpers import kvcr_router

pytestmark = pytest.mark.live_sglang
ARGS = ["--enable-cache-report"]


@pytest.fixture(scope="module")
def cluster(engines, tiny_model, tmp_path_factory):
    a, b = engines("clients-A", "clients-B", args=ARGS)
    tmp = tmp_path_factory.mktemp("router-clients")
    front = kvcr_router(tmp, tiny_model, [{"name": e.name, "url": e.url, "runner": e.endpoints["control"],
                                           "engine": "sglang"} for e in (a, b)], health_interval_s=0.5)
    try:
        yield front, a, b, tmp
    finally:
        front.stop()


def _without_times(value):
    """A model card's `created` is the second it was answered: not part of its shape."""
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if k != "created"}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


@pytest.mark.parametrize("path", ["/v1/models", "/model_info", "/get_model_info"])
def test_the_routes_clients_read_answer_as_an_engine_does(cluster, path):
    front, a, b, _ = cluster
    status, headers, routed = http(front.url + path)
    assert status == 200
    engine = a if headers["X-KVCR-Worker"] == a.name else b
    assert _without_times(json.loads(routed)) == _without_times(engine.get(path))


def test_server_info_flush_cache_and_health_generate_through_the_router(cluster):
    front, a, _, _ = cluster
    for path in ("/server_info", "/get_server_info"):
        status, _, raw = http(front.url + path)
        assert status == 200 and set(json.loads(raw)) == set(a.get("/server_info"))
    status, _, raw = http(front.url + "/flush_cache?timeout=30", {})
    assert status == 200 and raw.startswith(b"Cache flushed on all 2 workers."), raw
    status, _, raw = http(front.url + "/health_generate", timeout_s=120)
    assert status == 200 and raw.decode().count(": 200") == 2, raw


def test_sglangs_benchmark_client_runs_against_the_router_unchanged(cluster, tiny_model):
    front, _, _, tmp = cluster
    out = tmp / "bench.jsonl"
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", front.url,
           "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "4",
           "--gsp-system-prompt-len", "160", "--gsp-question-len", "24", "--gsp-output-len", "8",
           "--tokenizer", str(tiny_model), "--num-prompts", "8", "--request-rate", "4", "--max-concurrency", "2",
           "--seed", "3", "--output-file", str(out), "--cache-report", "--output-details", "--disable-tqdm"]
    run = subprocess.run(cmd, cwd=ROOT, env=harness_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    result = json.loads(out.read_text().splitlines()[-1])
    print(f"sglang.benchmark.serving through kvcr router: {result['completed']} completed, cache report "
          f"{result['cache_report']}, mean TTFT {result['mean_ttft_ms']:.0f} ms")  # shown with -s
    assert result["completed"] == 8 and not any(result["errors"]), result["errors"]
    # Eight prompts in two groups sharing a system prompt: the second of a group hits its prefix.
    assert result["cache_report"]["total_cached_tokens"] > 0, result["cache_report"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_completes_and_chats_through_the_router(cluster, stream):
    import openai

    front = cluster[0]
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    prompt = prompt_text(301, 60)
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, stream=stream)
    chat = client.chat.completions.create(model=model, max_tokens=5, temperature=0, stream=stream,
                                          messages=[{"role": "user", "content": prompt}])
    if stream:
        chunks = list(completion)
        assert chunks and all(c.object == "text_completion" for c in chunks)
        said = [c for c in chat if c.choices]
        assert said[-1].choices[0].finish_reason in ("length", "stop")
    else:
        assert completion.usage.completion_tokens == 5 and completion.choices[0].finish_reason == "length"
        assert chat.usage.completion_tokens == 5 and chat.choices[0].message.role == "assistant"


def test_an_engine_killed_while_requests_flow_costs_no_request_and_is_routed_to_again_once_back(cluster):
    front, a, b, _ = cluster
    outcomes: list[tuple[float, float, int, str]] = []  # (sent, answered, status, worker or error)
    stop = threading.Event()

    def flow(lane: int) -> None:
        for i in range(lane, 10_000, 2):
            if stop.is_set():
                return
            sent = time.monotonic()
            status, headers, raw = http(front.url + "/generate", {
                "text": prompt_text(400 + i, 90), "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
            outcomes.append((sent, time.monotonic(), status, headers.get("X-KVCR-Worker") or raw[-300:].decode()))

    lanes = [threading.Thread(target=flow, args=(lane,)) for lane in (0, 1)]
    for lane in lanes:
        lane.start()
    try:
        wait_until(lambda: {o[3] for o in outcomes} >= {a.name, b.name}, 60, 0.1, "both engines serving")
        killed_at = time.monotonic()
        b.stop(signal.SIGKILL)  # requests in flight there fail before their first byte: retried on A
        time.sleep(8)
    finally:
        stop.set()
        for lane in lanes:
            lane.join(120)
    after = [o for o in outcomes if o[1] > killed_at]  # answered after the kill (some were sent before it)
    assert after and all(o[2] == 200 for o in after), [o for o in after if o[2] != 200]
    assert {o[3] for o in after if o[0] > killed_at + 0.1} == {a.name}  # sent after the kill: all to A
    metrics = http(front.url + "/metrics")[2].decode()
    assert f'kvcr_router_breaker_trips_total{{worker="{b.name}"}} 1.0' in metrics or \
        f'kvcr_router_workers_down 1.0' in metrics  # seen by a refused request, or by its silent events first

    b.start().wait_ready()
    workers = lambda: {w["name"]: w["alive"] for w in json.loads(http(front.url + "/workers")[2])}
    failing = lambda: "kvcr_router_workers_failing 0.0" in http(front.url + "/metrics")[2].decode()
    wait_until(lambda: workers() == {a.name: True, b.name: True} and failing(), 60, 0.5, f"{b.name} routed to again")
    text = prompt_text(500, 120)
    status, headers, _ = http(front.url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 2}},
                              {"X-KVCR-Target": b.name})
    assert status == 200 and headers["X-KVCR-Worker"] == b.name
    wait_until(lambda: json.loads(http(front.url + "/debug/index", {"text": text})[2])["choice"]["worker"] == b.name,
               20, 0.2, f"{b.name}'s pages indexed")
    status, headers, _ = http(front.url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and headers["X-KVCR-Worker"] == b.name
