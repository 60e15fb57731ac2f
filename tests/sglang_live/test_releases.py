"""Each SGLang release kvcr supports (sglang_adapter/releases.py), live: a backup and a hit after
/flush_cache, a hinted peer pull that answers as a cold computation, and a revoked prefetch that
gives the peer's claim back at once. The newest release also runs the whole live suite; the older
ones run from the environments `make sglang-releases` builds."""

from __future__ import annotations

import sys

import pytest

from kvcr.proto.hints import build_envelope
from sglang_adapter import releases
from sglang_adapter.cpu_harness.model import prompt_text
from sglang_adapter.cpu_harness.server import ROOT, LiveServer
from tests.helpers import wait_until
from tests.sglang_live.helpers import metric

pytestmark = [pytest.mark.live_sglang, pytest.mark.sglang_release]
PAGE = 16
WAIT = ["--hicache-storage-prefetch-policy", "wait_complete"]


def release_python(version: str) -> str:
    if version == releases.SUPPORTED[-1]:
        return sys.executable  # the project's own environment
    python = ROOT / f".venv-sglang-{version}" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no environment for sglang {version}: run `make sglang-releases`")
    return str(python)


@pytest.fixture(scope="module", params=releases.SUPPORTED)
def pair(request, tiny_model, tmp_path_factory):
    """Engines A and B of one release, A holding 60 s claims for B (a revoked one must come back sooner)."""
    version = request.param
    run_dir = tmp_path_factory.mktemp(f"release-{version}")
    servers = [LiveServer(run_dir, f"r{version.replace('.', '')}-{n}", tiny_model, args=WAIT,
                          python=release_python(version), extra_config={"claim_lease_s": 60.0}) for n in "AB"]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        yield version, *servers
    finally:
        for s in servers:
            s.stop()


def runner_metric(server: LiveServer, name: str) -> float:
    return metric(server.runner_get("/metrics"), name)


def test_the_engine_runs_the_release_it_was_started_for_and_its_runner_is_up_before_any_request(pair):
    version, a, b = pair
    assert a.get("/server_info")["version"] == version
    # Before 0.5.23 the hooks say the host pools are registered (SGLang does not): nothing waits for a request.
    for server in (a, b):
        info = wait_until(lambda: _runner_info(server), timeout_s=30, message=f"{server.name}'s runner up")
        assert info["name"] == server.name


def _runner_info(server: LiveServer) -> dict | None:
    try:
        return server.runner_get("/info", timeout_s=2)
    except OSError:  # not listening yet
        return None


def test_a_backed_up_prompt_is_a_storage_hit_after_a_flush(pair, live):
    _, a, _ = pair
    text = prompt_text(500, 400)
    first = live.serve(a, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    live.flush(a)
    again = live.generate(a, text)
    assert again["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert again["output_ids"] == first["output_ids"]


def test_a_hinted_pull_answers_as_a_cold_computation(pair, live):
    _, a, b = pair
    text = prompt_text(510, 400)
    cold = live.serve(a, text)  # A computes it: the cold answer
    full = cold["meta_info"]["prompt_tokens"] // PAGE
    pulled = live.generate(b, text, kv_hints=build_envelope(a.endpoints["control"], a.stored_hashes()))
    assert pulled["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert pulled["output_ids"] == cold["output_ids"]
    assert live.logprobs(pulled) == live.logprobs(cold)
    assert runner_metric(b, "kvcr_pulled_pages_total") >= full
    wait_until(lambda: runner_metric(a, "kvcr_claims_held") == 0, timeout_s=10, message="A's claims released")


def test_a_revoked_prefetch_gives_the_peers_claim_back_at_once(pair, live):
    _, a, b = pair  # B asks a 60 s lease
    live.revoked_claim_comes_back(a, b, seed=520)
