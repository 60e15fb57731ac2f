"""Live: plain `--dp-size 2` (two replicas of the tiny Llama, no DP attention): SGLang's storage
config says rank 0 on both, the backend takes the replica's rank; each replica runs its runner at
base + rank, and one replica's pages serve the other."""

from __future__ import annotations

import pytest

from kvcr.client import fetch_info
from sglang_adapter.cpu_harness.model import prompt_text
from tests.helpers import wait_until
from tests.sglang_live.helpers import followed_blocks

pytestmark = [pytest.mark.live_sglang, pytest.mark.sglang_dp]
PAGE = 16


@pytest.fixture(scope="module")
def plain_dp(engines, tmp_path_factory):
    """Plain `--dp-size 2` (two replicas of the tiny Llama, no DP attention)."""
    (engine,) = engines("dp-plain", args=["--dp-size", "2", "--hicache-storage-prefetch-policy", "wait_complete",
                                          "--enable-cache-report"],
                        peers_dir=str(tmp_path_factory.mktemp("plain-peers")),
                        env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    return engine


def test_under_plain_dp_each_replica_is_a_rank_and_one_replicas_pages_serve_the_other(plain_dp, live):
    engine = plain_dp
    assert [fetch_info(engine.rank(r)["http"])["dp_rank"] for r in (0, 1)] == [0, 1]
    text = prompt_text(730, 400)
    cold = live.on_rank(engine, 0, text)
    full = cold["meta_info"]["prompt_tokens"] // PAGE
    wait_until(lambda: len(live.rank_stored(engine, 0)) >= full, timeout_s=30, message="replica 0 backed the prompt up")
    wait_until(lambda: followed_blocks(live.rank_metrics(engine, 1), engine.rank(0)["control"]) >= full,
               timeout_s=30, message="replica 1 follows replica 0's stream")
    pulled = live.on_rank(engine, 1, text)
    assert pulled["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert pulled["output_ids"] == cold["output_ids"]
    assert live.logprobs(pulled) == live.logprobs(cold)
