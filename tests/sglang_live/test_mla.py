"""Live test 5, MLA: a tiny DeepSeek-V2 engine backs up its latent pages (one buffer per layer,
no K/V split) and hits them after a flush, pulls them from an MLA peer on a hint, and with TP = 2
its ranks share one shard in a `kvcr serve` sidecar (the ranks hold the same KV under MLA)."""

from __future__ import annotations

import pytest

from kvcr.client import ControlClient
from kvcr.proto.events import BlockStored
from kvcr.proto.hints import build_envelope
from sglang_adapter.cpu_harness.model import MLA_PAGE_BYTES, prompt_text
from tests.helpers import RunnerProcess, wait_until
from tests.sglang_live.helpers import metric

pytestmark = pytest.mark.live_sglang
PAGE = 16
WAIT = ["--hicache-storage-prefetch-policy", "wait_complete"]


@pytest.fixture(scope="module")
def pair(engines, mla_model):
    return engines("mla-A", "mla-B", model=mla_model, args=WAIT)


@pytest.fixture(scope="module")
def tp2(engines, mla_model, tmp_path_factory):
    sidecar = RunnerProcess(tmp_path_factory.mktemp("mla-sidecar"), "mla-sidecar", {
        "runner.block_size": PAGE, "namespace.model": str(mla_model), "namespace.tp_size": 2,
        "namespace.is_mla": True, "namespace.layout": "page_first", "namespace.dtype": "bfloat16",
        "dram.size": "16Mi", "dram.pools": [{"name": "kv", "page_bytes": MLA_PAGE_BYTES, "shards": 1}],
        "runner.peers": ["*"]})
    control = sidecar.start()["endpoints"]["control"]
    (engine,) = engines("mla-tp2", model=mla_model, extra_config={"sidecar": control},
                        env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}, args=["--tp", "2", *WAIT])
    yield engine, control
    sidecar.stop()


def announced(control: str) -> list[int]:
    with ControlClient(control) as client:
        return [h for e in client.snapshot()[1] if isinstance(e, BlockStored) for h in e.block_hashes]


def test_an_mla_engine_backs_up_its_latent_pages_and_hits_them_after_a_flush(pair, live):
    a, _ = pair
    text = prompt_text(600, 300)
    first = live.serve(a, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    assert all(p["namespace"]["mla"] for p in a.runner_get("/info")["pools"])
    live.flush(a)
    again = live.generate(a, text)
    assert again["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert again["output_ids"] == first["output_ids"]
    assert live.logprobs(again) == live.logprobs(first)


def test_an_mla_engine_pulls_an_mla_peers_latent_pages_on_a_hint(pair, live):
    a, b = pair
    text = prompt_text(610, 400)
    first = live.serve(a, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    pulled = live.generate(b, text, kv_hints=build_envelope(a.endpoints["control"], a.stored_hashes()))
    assert pulled["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert pulled["output_ids"] == first["output_ids"]
    assert live.logprobs(pulled) == live.logprobs(first)
    assert metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total") >= full
    wait_until(lambda: metric(a.runner_get("/metrics"), "kvcr_claims_held") == 0, timeout_s=10,
               message="A's claims released")


def test_tp2_mla_ranks_back_up_one_shared_shard_and_both_hit_after_a_flush(tp2, live):
    engine, control = tp2
    text = prompt_text(620, 300)
    first = live.generate(engine, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    wait_until(lambda: len(announced(control)) >= full, timeout_s=30, message="the prompt's pages in the sidecar")
    stored = announced(control)  # one shard: the ranks' identical KV is stored once (output pages too)
    assert len(set(stored)) == len(stored) <= (first["meta_info"]["prompt_tokens"] + 4) // PAGE
    live.flush(engine)
    again = live.generate(engine, text)  # SGLang takes the smallest hit over the ranks
    assert again["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert again["output_ids"] == first["output_ids"]
    assert live.logprobs(again) == live.logprobs(first)
