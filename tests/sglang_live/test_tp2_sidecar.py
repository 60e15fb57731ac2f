"""Live test 5: a TP = 2 engine whose ranks attach to one `kvcr serve` sidecar: each rank backs
up its heads of a page into the shared page, and after /flush_cache both ranks read their slices
back (SGLang's CPU TP runs its ranks over gloo, each bound to one core here)."""

from __future__ import annotations

import pytest

from kvcr.client import ControlClient
from kvcr.proto.events import BlockStored
from sglang_adapter.cpu_harness.model import prompt_text
from tests.helpers import RunnerProcess, wait_until

pytestmark = pytest.mark.live_sglang
PAGE = 16
RANK_PAGE = 2048  # one rank's heads of a tiny-model page: 2 layers x 1 KV head x 16 dims x bf16 x (K, V) x 16


@pytest.fixture(scope="module")
def tp2(engines, tiny_model, tmp_path_factory):
    sidecar = RunnerProcess(tmp_path_factory.mktemp("sidecar"), "tp2-sidecar", {
        "runner.block_size": PAGE, "namespace.model": str(tiny_model), "namespace.tp_size": 2,
        "namespace.layout": "page_first", "namespace.dtype": "bfloat16", "dram.size": "16Mi",
        "dram.pools": [{"name": "kv", "page_bytes": 2 * RANK_PAGE, "shards": 2}], "runner.peers": ["*"]})
    info = sidecar.start()
    control = info["endpoints"]["control"]
    (engine,) = engines("tp2", extra_config={"sidecar": control}, env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
                        args=["--tp", "2", "--hicache-storage-prefetch-policy", "wait_complete"])
    yield engine, control
    sidecar.stop()


def announced(control: str) -> int:
    with ControlClient(control) as client:
        return sum(len(e.block_hashes) for e in client.snapshot()[1] if isinstance(e, BlockStored))


def test_both_ranks_back_up_into_the_sidecar_and_read_their_slices_after_a_flush(tp2, live):
    engine, control = tp2
    text = prompt_text(300, 300)
    first = live.generate(engine, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    wait_until(lambda: announced(control) >= full, timeout_s=30, message="whole pages (both shards) in the sidecar")
    live.flush(engine)
    again = live.generate(engine, text)
    assert again["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert again["output_ids"] == first["output_ids"]
    assert live.logprobs(again) == live.logprobs(first)
