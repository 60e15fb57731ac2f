"""A prefix the engine keeps serving from its own pools stays in its runner: the hook tells the
backend of every such hit, so the runner's LRU lets go of the pages nobody uses instead."""

from __future__ import annotations

import pytest

from sglang_adapter.cpu_harness.model import prompt_text

pytestmark = pytest.mark.live_sglang
PAGE = 16


def test_pages_the_engine_keeps_hitting_outlive_newer_pages_in_its_runner(engines, live):
    (engine,) = engines("engine-hits", runner={"dram.size": "96Ki"})
    slots = min(pool["num_slots"] for pool in engine.runner_get("/info")["pools"])
    hot = prompt_text(31, 90)
    live.serve(engine, hot)
    hot_pages = set(engine.stored_hashes())
    first_cold = None
    for i in range(64):  # new prompts, each followed by the hot one (served by the engine itself)
        before = set(engine.stored_hashes())
        live.serve(engine, prompt_text(1000 + i, 90))
        first_cold = first_cold or set(engine.stored_hashes()) - before
        again = live.generate(engine, hot)
        assert again["meta_info"]["cached_tokens"] >= len(hot_pages) * PAGE
        assert again["meta_info"]["cached_tokens_details"].get("storage", 0) == 0, "the engine's own pools serve it"
        if (i + 1) * len(first_cold) > 2 * slots:
            break
    held = set(engine.stored_hashes())
    assert not first_cold & held, "the runner never had to evict: the test proves nothing"
    assert hot_pages <= held, "the runner evicted the pages its engine kept serving"
