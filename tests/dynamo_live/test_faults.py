"""Faults under Dynamo's router: its view converges to what runners hold, and a stale view costs a miss."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from kvcr.client import AttachedWriter, ControlClient
from kvcr.dynamo.launch import BridgeOptions, dynamo_python, start_bridge, stop_process
from kvcr.dynamo.model_dir import write_model_dir
from kvcr.proto.announce import announce_request
from kvcr.proto.events import MEDIUM_DISK, MEDIUM_DRAM
from kvcr.dynamo.local import free_port
from tests.dynamo_live.helpers import MODEL, NAMESPACE, TOKENIZER, prompt, wait_for
from tests.dynamo_live.helpers import full_blocks as blocks
from tests.pages import pages_for

CONVERGE_S = 10  # the bound: Dynamo's view matches the runner within 10 s


def put(control: str, keys, data, announces) -> None:
    """Store pages in a runner through its control socket, announced as an engine would."""
    with ControlClient(control) as client:
        writer = AttachedWriter(client)
        writer.put("kv", keys, data, announces)
        writer.close()


def view(probe, worker_id: int, tokens: list[int], rank: int = 0) -> dict | None:
    return probe.overlaps(tokens).get((worker_id, rank))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_crashed_or_stopped_worker_leaves_dynamo_and_its_restart_starts_from_what_it_holds(dynamo, sig, tmp_path):
    fe = dynamo.frontend()
    wa, wb = (dynamo.worker(n, "--set", f"nvme.storage_dir={tmp_path / (n + '.nvme')}") for n in ("wa", "wb"))
    probe = dynamo.probe()
    p = prompt("lost")
    tokens = TOKENIZER.encode(p)
    fe.complete(p)
    holder, other = (wa, wb) if wa.stats()["stats"]["requests"] == 1 else (wb, wa)
    wait_for(lambda: (view(probe, holder.dynamo_id, tokens) or {}).get("host") == blocks(p), CONVERGE_S,
             "the holder's pages in Dynamo")
    wait_for(lambda: holder.stats()["tiers"]["nvme_pages"] >= blocks(p), 20, "the pages written behind to NVMe")
    old_id = holder.dynamo_id
    holder.stop(sig, 30)  # its bridge dies with it and deregisters: Dynamo drops the worker and its blocks
    wait_for(lambda: view(probe, old_id, tokens) is None, CONVERGE_S, "the dead worker gone from Dynamo")
    # One worker left: Dynamo routes there with no hint naming the dead runner, and the answer is right.
    answer = fe.complete(p, max_tokens=6)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stats = other.stats()["stats"]
    assert stats["peer_pages"] == 0 and stats["hint_errors"] == 0 and stats["oracle_mismatches"] == 0
    holder.start()  # same runner state and NVMe directory, a new Dynamo registration
    assert holder.dynamo_id != old_id
    # DRAM is gone either way; NVMe kept the pages (written behind; flushed on SIGTERM). Dynamo sees
    # exactly that, as disk blocks: never host-pinned, so it never names them in a hint.
    wait_for(lambda: (view(probe, holder.dynamo_id, tokens) or {}).get("disk") == blocks(p), CONVERGE_S,
             "the NVMe pages re-announced to Dynamo")
    assert view(probe, holder.dynamo_id, tokens)["host"] == 0


def test_a_restarted_frontend_recovers_the_index_from_the_workers(dynamo):
    fe = dynamo.frontend()
    wa, wb = dynamo.worker("wa"), dynamo.worker("wb")
    p = prompt("recover")
    fe.complete(p)
    holder = wa if wa.stats()["stats"]["requests"] == 1 else wb
    fe.stop()
    fe2 = dynamo.frontend()  # knows nothing published before it started
    wait_for(lambda: MODEL in fe2.models(), 60, "the workers rediscovered")
    # Dynamo's own recovery (the workers' local indexers) refills a new router's index: a probe
    # started after the new frontend shows it; nothing is published meanwhile.
    probe = dynamo.probe()
    wait_for(lambda: (view(probe, holder.dynamo_id, TOKENIZER.encode(p)) or {}).get("host") == blocks(p),
             CONVERGE_S, "a new router's index recovered from the workers")
    fe2.complete(p + " again")  # one try: a misrouted one would store the prefix at the other worker
    choice = fe2.selections()[-1]
    assert int(choice["worker_id"]) == holder.dynamo_id and int(choice["host_pinned_blocks"]) == blocks(p), choice


def test_a_runner_on_dp_rank_1_is_indexed_at_rank_1(dynamo):
    dynamo.frontend()
    w = dynamo.worker("w1", "--set", "runner.dp_rank=1")
    probe = dynamo.probe()
    keys, ann, data = pages_for(5, seed=21, page_bytes=w.info["kvcr_runner"]["pools"][0]["page_bytes"])
    tokens = [t for a in ann for t in a.token_ids]
    put(w.info["kvcr_runner"]["endpoints"]["control"], keys, data, ann)
    got = wait_for(lambda: (view(probe, w.dynamo_id, tokens, rank=1) or {}).get("host") == 5, CONVERGE_S,
                   "the rank-1 pages in Dynamo")
    assert got and view(probe, w.dynamo_id, tokens, rank=0) is None


def test_a_bridge_whose_dp_rank_differs_from_the_runners_refuses_to_start(dynamo, tmp_path):
    w = dynamo.worker("w0")
    options = BridgeOptions(backend=w.url, model_path=str(tmp_path), model_name="m", dp_rank=3,
                            python=dynamo_python())
    proc = subprocess.run(options.argv(), env=dynamo.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--dp-rank 3 differs from the runner's runner.dp_rank 0" in proc.stderr


def test_a_runner_restarted_under_a_live_bridge_is_resynced_in_dynamo(dynamo, runner_factory, tmp_path):
    """The SGLang topology: the runner is its own process, the bridge outlives its restarts."""
    dynamo.frontend()
    fixed = {"events.endpoint": f"tcp://127.0.0.1:{free_port()}",
             "events.replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
             "runner.control_endpoint": f"tcp://127.0.0.1:{free_port()}",
             "dram.pools": [{"name": "kv", "page_bytes": 4096}]}
    runner = runner_factory("solo", **fixed)
    info = runner.start()
    model_dir = write_model_dir(tmp_path, tokenizer_json=TOKENIZER.path, vocab_size=TOKENIZER.vocab_size,
                                max_positions=8192, bos_id=None, eos_id=TOKENIZER.eos_id, special={})
    ready = tmp_path / "bridge.json"
    bridge = start_bridge(BridgeOptions(backend=info["endpoints"]["http"], runner=info["endpoints"]["http"],
                                        model_path=str(model_dir), model_name="solo-model", python=dynamo_python(),
                                        ready_file=str(ready)), log_path=str(tmp_path / "bridge.log"), env=dynamo.env)
    try:
        wait_for(ready.exists, 60, "the bridge registered")
        worker_id = json.loads(ready.read_text())["worker_id"]
        probe = dynamo.probe()
        keys, ann, data = pages_for(6, seed=31, page_bytes=4096)
        tokens = [t for a in ann for t in a.token_ids]
        put(info["endpoints"]["control"], keys, data, ann)
        wait_for(lambda: (view(probe, worker_id, tokens) or {}).get("host") == 6, CONVERGE_S, "pages in Dynamo")
        runner.stop(signal.SIGKILL)  # no removals, and its restart's first batches reach no subscriber
        runner.start()
        wait_for(lambda: (view(probe, worker_id, tokens) or {}).get("host") == 0, CONVERGE_S,
                 "Dynamo's view of the restarted runner emptied")
        put(info["endpoints"]["control"], keys[:3], data[:3], ann[:3])
        wait_for(lambda: (view(probe, worker_id, tokens) or {}).get("host") == 3, CONVERGE_S,
                 "the restarted runner's new pages in Dynamo")
    finally:
        stop_process(bridge)


def test_dram_and_nvme_churn_never_double_counts_a_block_in_dynamo(dynamo, tmp_path):
    """Evictions, write-behind, promotions and re-spills under Dynamo's own reference counting."""
    fe = dynamo.frontend()
    w = dynamo.worker("churn", "--set", "dram.size=1Mi", "--set", f"nvme.storage_dir={tmp_path / 'nvme'}",
                      "--set", "dram.high_watermark=0.85", "--set", "dram.low_watermark=0.7")
    probe = dynamo.probe()
    prompts = [prompt(f"churn{i}-") for i in range(8)]
    for text in prompts + prompts[:4] + prompts:  # later rounds hit pages evicted to NVMe, then promoted
        fe.complete(text, max_tokens=2)
    tiers = w.stats()["tiers"]
    assert tiers["spilled_pages"] > 0 and tiers["promoted_pages"] > 0, tiers  # the churn happened
    # Dynamo's view equals what the runner holds, tier by tier, for every prompt.
    with ControlClient(w.info["kvcr_runner"]["endpoints"]["control"]) as client:
        def agrees() -> bool:
            _, events = client.snapshot()
            held = {(e.medium, h) for e in events for h in e.block_hashes}
            for text in prompts:
                hashes = [a.event_hash for a in announce_request(TOKENIZER.encode(text), 16)]
                def lead(*media: str) -> int:
                    return next((i for i, h in enumerate(hashes) if not any((m, h) in held for m in media)),
                                len(hashes))
                seen = view(probe, w.dynamo_id, TOKENIZER.encode(text))
                # Dynamo reports the prefix on host-pinned, and the prefix on host-pinned or disk.
                if (seen["host"], seen["disk"]) != (lead(MEDIUM_DRAM), lead(MEDIUM_DRAM, MEDIUM_DISK)):
                    return False
            return True
        wait_for(agrees, CONVERGE_S, "Dynamo's view equal to the runner's inventory")
    warnings = fe.metric_sums("dynamo_component_kv_cache_event_warnings")
    assert warnings and all(v == 0 for v in warnings.values()), warnings
    applied = fe.metric_sums("dynamo_component_kv_cache_events_applied")
    assert all(v == 0 for k, v in applied.items() if "status=ok" not in k), applied
    assert sum(v for k, v in applied.items() if "status=ok" in k and "event_type=removed" in k) > 0, applied


@pytest.mark.parametrize("discovery", ["etcd"], indirect=True)
def test_a_kvcr_router_follows_the_workers_registered_in_dynamos_etcd(dynamo, dyn_env, tmp_path):
    """`router.dynamo_discovery`: our router, next to Dynamo, takes its workers from Dynamo's
    discovery (the bridges' model cards in etcd): both join, requests route, and a worker whose
    bridge deregisters leaves."""
    from kvcr.demo.procs import Child
    from tests.cluster import http
    from tests.helpers import ROOT

    dynamo.worker("wa")
    wb = dynamo.worker("wb")
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"router": {"port": 0, "dynamo_discovery": dyn_env["ETCD_ENDPOINTS"],
                                          "dynamo_namespace": NAMESPACE}}))
    front = Child(tmp_path, "router", ["router", "--config", str(cfg)], cwd=ROOT).start()
    try:
        front.wait_ready()
        names = lambda: {w["name"]: w["alive"] for w in json.loads(http(front.url + "/workers")[2])}
        wait_for(lambda: names() == {"wa": True, "wb": True}, 30, "both workers joined from etcd")
        status, headers, _ = http(front.url + "/generate", {"text": "routed from Dynamo's discovery " * 8,
                                                            "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and headers["X-KVCR-Worker"] in ("wa", "wb")
        wb.stop(signal.SIGTERM, 20)  # its bridge deregisters: the card leaves etcd
        wait_for(lambda: names() == {"wa": True}, 30, "wb left with its card")
    finally:
        front.stop()
