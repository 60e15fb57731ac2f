"""Live SGLang engines (`--hicache-storage-backend kvcr`) behind Dynamo's unmodified frontend.

Each engine gets the thin kvcr bridge: it registers with Dynamo, relays the engine runner's event
stream, and forwards Dynamo's token requests (with `kv_hint`, as SGLang's `kv_hints`) to the
engine's `/generate`. Nothing of SGLang or Dynamo is patched.
"""

from __future__ import annotations

import json
import threading

import pytest

from kvcr.demo.httpc import http
from kvcr.dynamo.launch import BridgeOptions, dynamo_python, start_bridge, stop_process
from tokenizers import Tokenizer
from tests.dynamo_live.helpers import BLOCK, wait_for

pytestmark = pytest.mark.live_sglang

MODEL_NAME = "tiny-llama"


@pytest.fixture
def sglang_pair(dynamo, tmp_path):
    from sglang_adapter.cpu_harness.model import build_model
    from sglang_adapter.cpu_harness.server import LiveServer

    model = build_model(tmp_path / "tiny-llama")
    fe = dynamo.frontend()
    # On 2 shared cores the busy holder's in-process runner can answer a claim after the default
    # control timeout and prefetch budget, which makes Dynamo's hint a miss (the designed outcome,
    # tested in test_hint_faults.py); here the pull itself is under test, so both wait for it.
    # Each runner's DRAM (64 pages of 8 KiB) is smaller than its engine's host pool (512): the engine's own
    # events, relayed by default, carry blocks the runner may not hold, which Dynamo must never hint.
    engines = [LiveServer(tmp_path, name, model, runner={"runner.control_timeout_s": 10.0, "dram.size": "512Ki"},
                          args=["--hicache-storage-prefetch-policy", "wait_complete"]) for name in ("sa", "sb")]
    bridges = []
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
            ready = tmp_path / f"{e.name}.bridge.json"
            bridges.append(start_bridge(BridgeOptions(backend=e.url, runner=e.runner_http, model_path=str(model),
                                                      model_name=MODEL_NAME, python=dynamo_python(),
                                                      ready_file=str(ready)),
                                        log_path=str(tmp_path / f"{e.name}.bridge.log"), env=dynamo.env))
            wait_for(ready.exists, 90, f"{e.name}'s bridge registered")
            e.dynamo_id = json.loads(ready.read_text())["worker_id"]
        probe = dynamo.probe()
        # Dynamo's frontend sends a completion prompt's ids without special tokens (no BOS, where SGLang adds one).
        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        wait_for(lambda: len(probe.overlaps(tokenizer.encode("warm up").ids)) == 2, 60, "both engines in Dynamo")
        yield fe, engines, probe, tokenizer
    finally:
        for b in bridges:
            stop_process(b)
        for e in engines:
            e.stop()


def complete(fe, prompt: str, max_tokens: int = 4, **extra) -> dict:
    status, _, body = http(fe.url + "/v1/completions", {"model": MODEL_NAME, "prompt": prompt,
                                                        "max_tokens": max_tokens, "temperature": 0, **extra},
                           timeout_s=240)
    assert status == 200, body[:500]
    return json.loads(body)


def engine_answer(engine, tokens: list[int], max_tokens: int) -> list[int]:
    """The engine's own greedy answer for the same ids, computed with its caches flushed (the oracle)."""
    engine.post("/flush_cache", {})
    out = engine.post("/generate", {"input_ids": tokens, "sampling_params": {
        "max_new_tokens": max_tokens, "temperature": 0}})
    return out["output_ids"]


def runner_metric(engine, name: str) -> float:
    text = http(engine.runner_http + "/metrics")[2].decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


# The same topology with file discovery (one host) and etcd (what deployments across hosts use).
@pytest.mark.parametrize("discovery", ["file", "etcd"], indirect=True)
def test_sglang_engines_behind_dynamo_reuse_and_pull_on_dynamos_hint(sglang_pair):
    fe, (sa, sb), probe, tok = sglang_pair
    p = words("alpha", 80)
    tokens = tok.encode(p, add_special_tokens=False).ids
    full = len(tokens) // BLOCK
    assert complete(fe, p)["usage"]["prompt_tokens"] == len(tokens)
    holder = next(e for e in (sa, sb) if int(fe.selections()[-1]["worker_id"]) == e.dynamo_id)
    other = sb if holder is sa else sa
    # The engine's device blocks reach Dynamo through its runner's stream, once the runner holds them too.
    wait_for(lambda: probe.overlaps(tokens)[(holder.dynamo_id, 0)]["device"] >= full - 1, 20,
             "the holder's device blocks in Dynamo")
    follow = complete(fe, p + " then more")
    assert int(fe.selections()[-1]["worker_id"]) == holder.dynamo_id
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] >= (full - 1) * BLOCK
    # The holder made busy by a long request on the same prefix: Dynamo hints the other engine.
    errors: list[BaseException] = []
    long = threading.Thread(target=lambda: _capture(errors, complete, fe, p + " " + words("tail", 200),
                                                    max_tokens=300, ignore_eos=True))
    long.start()
    try:
        # Once routed, Dynamo counts the long request's blocks as the holder's load.
        wait_for(lambda: len(fe.selections()) >= 3, 30, "the long request routed")
        ask = p + " another question"
        answer = complete(fe, ask, max_tokens=6)
    finally:
        long.join(300)
    assert not errors, errors
    choice = fe.selections()[-1]
    assert int(choice["worker_id"]) == other.dynamo_id, choice
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (full - 1) * BLOCK, answer["usage"]  # pulled from the holder's runner over UCX
    # The pull's other half: the holder's runner served the pages under a claim, now released.
    assert runner_metric(holder, "kvcr_hits_total") >= full - 1
    wait_for(lambda: runner_metric(holder, "kvcr_claims_held") == 0, 10, "the holder's claims released")
    assert tok.decode(engine_answer(other, tok.encode(ask, add_special_tokens=False).ids, 6)) == answer["choices"][0]["text"]
    wait_for(lambda: held(probe, tokens, other) >= full - 1, 20,
             "the pulled pages kept and announced by the other engine's runner")
    # Dynamo's hint named only pages the holder's runner held.
    assert runner_metric(holder, 'kvcr_hint_unheld_pages_total{cause="never_held"}') == 0


def held(probe, tokens: list[int], engine, salt: str | None = None) -> int:
    """Leading blocks Dynamo believes `engine` holds on device or in host memory (its runner's DRAM)."""
    seen = probe.overlaps(tokens, salt)[(engine.dynamo_id, 0)]
    return max(seen["device"], seen["host"])


def _capture(errors: list, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported by the test thread
        errors.append(exc)


def test_a_tenants_pages_behind_dynamo_serve_only_its_own_salt(sglang_pair):
    """Dynamo's `nvext.cache_salt` reaches SGLang as its `cache_salt`: the engine's pages are keyed,
    announced and found under the tenant's namespace only."""
    fe, engines, probe, tok = sglang_pair
    p = words("tenant", 80)
    tokens = tok.encode(p, add_special_tokens=False).ids
    full = len(tokens) // BLOCK
    complete(fe, p, nvext={"cache_salt": "tenant-a"})
    holder = next(e for e in engines if int(fe.selections()[-1]["worker_id"]) == e.dynamo_id)
    wait_for(lambda: held(probe, tokens, holder, "tenant-a") >= full - 1, 20, "the holder's tenant-a pages in Dynamo")
    assert held(probe, tokens, holder) == 0
    for salt in (None, "tenant-b"):
        answer = complete(fe, p + " then more", **({"nvext": {"cache_salt": salt}} if salt else {}))
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, salt
    again = complete(fe, p + " then more", nvext={"cache_salt": "tenant-a"})
    assert int(fe.selections()[-1]["worker_id"]) == holder.dynamo_id
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= (full - 1) * BLOCK


@pytest.mark.sglang_dp
def test_one_bridge_registers_every_dp_rank_and_dynamo_routes_a_prefix_to_the_rank_holding_it(dynamo, tmp_path):
    """A DP-attention engine (tiny DeepSeek-V2, `--dp-size 2`) behind one bridge given rank 0's
    runner: Dynamo sees each rank's pages under (worker, rank) and runs a follow-up on that rank."""
    from sglang_adapter.cpu_harness.model import build_mla_model
    from sglang_adapter.cpu_harness.server import LiveServer

    model = build_mla_model(tmp_path / "tiny-mla")
    fe = dynamo.frontend()
    engine = LiveServer(tmp_path, "sdp", model, env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
                        args=["--tp", "2", "--dp-size", "2", "--enable-dp-attention",
                              "--hicache-storage-prefetch-policy", "wait_complete"])
    bridge = None
    try:
        engine.start().wait_ready()
        ready = tmp_path / "sdp.bridge.json"
        bridge = start_bridge(BridgeOptions(backend=engine.url, runner=engine.rank(0)["http"],
                                            model_path=str(model), model_name=MODEL_NAME, python=dynamo_python(),
                                            ready_file=str(ready)),
                              log_path=str(tmp_path / "sdp.bridge.log"), env=dynamo.env)
        wait_for(ready.exists, 90, "the bridge registered")
        registered = json.loads(ready.read_text())
        assert registered["dp_ranks"] == [0, 1]
        worker = registered["worker_id"]
        probe = dynamo.probe()
        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        p = words("delta", 80)
        tokens = tokenizer.encode(p, add_special_tokens=False).ids
        full = len(tokens) // BLOCK
        engine.post("/generate", {"input_ids": tokens, "routed_dp_rank": 1,
                                  "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        wait_for(lambda: max(probe.overlaps(tokens).get((worker, 1), {"device": 0}).values()) >= full - 1, 30,
                 "rank 1's blocks in Dynamo under (worker, 1)")
        assert max(probe.overlaps(tokens).get((worker, 0), {"device": 0}).values()) == 0
        follow = complete(fe, p + " then more")
        choice = fe.selections()[-1]
        assert (int(choice["worker_id"]), int(choice["dp_rank"])) == (worker, 1), choice
        assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] >= (full - 1) * BLOCK  # rank 1's own pages
    finally:
        if bridge is not None:
            stop_process(bridge)
        engine.stop()
