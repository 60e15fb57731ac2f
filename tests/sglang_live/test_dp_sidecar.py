"""Live: a DP-attention engine whose ranks attach to sidecars, one `kvcr serve` per DP rank, all
started with the same base control port and each with its runner.dp_rank: rank r attaches to
base + r, backs up there and reads its pages back after a flush."""

from __future__ import annotations

import pytest

from kvcr.client import ControlClient
from kvcr.proto.events import BlockStored
from sglang_adapter.cpu_harness.model import MLA_PAGE_BYTES, prompt_text
from sglang_adapter.cpu_harness.server import free_port
from tests.helpers import RunnerProcess, wait_until
from tests.sglang_live.helpers import DP_ATTENTION

pytestmark = [pytest.mark.live_sglang, pytest.mark.sglang_dp]
PAGE = 16


@pytest.fixture(scope="module")
def dp_sidecars(engines, mla_model, tmp_path_factory):
    """A DP-attention engine whose ranks attach to sidecars: one `kvcr serve` per rank, each started
    with the same base control port and its runner.dp_rank (it binds base + rank)."""
    tmp = tmp_path_factory.mktemp("dp-sidecars")
    port = free_port(2)
    base = f"tcp://127.0.0.1:{port}"
    sidecars = [RunnerProcess(tmp, f"dp-sidecar{rank}", {
        "runner.dp_size": 2, "runner.dp_rank": rank, "runner.control_endpoint": base, "runner.block_size": PAGE,
        "namespace.model": str(mla_model), "namespace.is_mla": True, "namespace.layout": "page_first",
        "namespace.dtype": "bfloat16", "dram.size": "16Mi",
        "dram.pools": [{"name": "kv", "page_bytes": MLA_PAGE_BYTES, "shards": 1}]}) for rank in (0, 1)]
    controls = [s.start()["endpoints"]["control"] for s in sidecars]
    try:
        (engine,) = engines("dp-sidecar", model=mla_model, extra_config={"sidecar": base}, args=DP_ATTENTION,
                            env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
        assert controls == [f"tcp://127.0.0.1:{port + rank}" for rank in (0, 1)]
        yield engine, controls
    finally:
        for s in sidecars:
            s.stop()


def test_each_rank_attaches_to_its_own_sidecar_and_reads_its_pages_back_after_a_flush(dp_sidecars, live):
    engine, controls = dp_sidecars

    def held(control: str) -> int:
        with ControlClient(control) as client:
            return sum(len(e.block_hashes) for e in client.snapshot()[1] if isinstance(e, BlockStored))
    text = prompt_text(720, 300)
    first = live.on_rank(engine, 1, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    wait_until(lambda: held(controls[1]) >= full, timeout_s=30, message="rank 1's pages in its sidecar")
    assert held(controls[0]) == 0  # rank 0 computed nothing
    live.flush(engine)
    again = live.on_rank(engine, 1, text)
    assert again["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert again["output_ids"] == first["output_ids"]
    assert live.logprobs(again) == live.logprobs(first)
