"""Live SGLang engines for the `live_sglang` tests: the tiny model once per session, engines per
module (each ~15 s to start and ~2 GB; at most three at once on this machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_adapter.cpu_harness.model import build_mla_model, build_model
from sglang_adapter.cpu_harness.server import LiveServer
from tests.sglang_live.helpers import metric

pytestmark = pytest.mark.live_sglang


def _have_sglang() -> bool:
    try:
        from importlib.metadata import version
        return version("sglang") == "0.5.23"
    except Exception:  # noqa: BLE001 - not installed: skipped below
        return False


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    if not _have_sglang():
        pytest.skip("sglang 0.5.23 is not installed (make sglang-setup)")
    return build_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def mla_model(tiny_model, tmp_path_factory) -> Path:
    """A tiny DeepSeek-V2: MLA's one latent KV row per token and layer."""
    return build_mla_model(tmp_path_factory.mktemp("tiny-mla"))


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_model):
    """make(*names, runner=..., args=..., each={name: {"runner": ...}}, model=...) -> started,
    healthy LiveServers (started together; the tiny Llama unless `model`); all stopped at module end."""
    run_dir = tmp_path_factory.mktemp("engines")
    made: list[LiveServer] = []

    def make(*names: str, each: dict | None = None, runner: dict | None = None, model: Path | None = None,
             **options) -> list[LiveServer]:
        servers = [LiveServer(run_dir, name, model or tiny_model, runner={**(runner or {}), **(each or {}).get(name, {})},
                              **options) for name in names]
        made.extend(servers)
        for s in servers:
            s.start()
        return [s.wait_ready() for s in servers]

    yield make
    for s in made:
        s.stop()


def generate(server: LiveServer, text: str | None = None, *, input_ids: list[int] | None = None,
             max_new_tokens: int = 4, **extra) -> dict:
    """A greedy /generate with logprobs; returns the response (meta_info holds cached_tokens)."""
    body = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, **extra}
    body.update({"input_ids": input_ids} if input_ids is not None else {"text": text})
    return server.post("/generate", body)


def logprobs(response: dict) -> list[tuple[float, int]]:
    return [(round(lp, 4), tok) for lp, tok, *_ in response["meta_info"]["output_token_logprobs"]]


def flush(server: LiveServer, timeout_s: float = 30.0) -> None:
    server.flush(timeout_s)


def serve(server: LiveServer, text: str, timeout_s: float = 30.0, **extra) -> dict:
    """generate, then wait until the engine backed this prompt's full pages up into its runner
    (pages it did not hold before: a runner shared by earlier tests already holds others)."""
    from tests.helpers import wait_until

    before = set(server.stored_hashes())
    answer = generate(server, text, **extra)
    full = answer["meta_info"]["prompt_tokens"] // 16
    if answer["meta_info"]["cached_tokens"] >= full * 16:
        return answer  # served from cache: backed up when it was first computed
    wait_until(lambda: len(set(server.stored_hashes()) - before) >= full, timeout_s=timeout_s,
               message=f"{server.name} backed the prompt's {full} pages up")
    return answer


def scheduler(server: LiveServer):
    """The engine's scheduler process (its in-process runner lives there)."""
    import psutil

    procs = psutil.Process(server.proc.pid).children(recursive=True)
    return next(p for p in procs if "scheduler" in " ".join(p.cmdline()))


def pulls_again(source: LiveServer, puller: LiveServer, text: str) -> None:
    """`source` (restarted) serves `text`; `puller`, flushed, then pulls all its full pages on a hint
    and answers as the source did; the source ends with no claim."""
    from kvcr.proto.hints import build_envelope
    from tests.helpers import wait_until

    at_source = serve(source, text)
    envelope = build_envelope(source.endpoints["control"], source.stored_hashes())

    def pulled():
        flush(puller)
        got = generate(puller, text, kv_hints=envelope)
        return got if got["meta_info"]["cached_tokens"] > 0 else None
    got = wait_until(pulled, timeout_s=60, interval_s=1.0, message=f"{puller.name} pulls from the restarted {source.name}")
    assert got["meta_info"]["cached_tokens_details"]["storage"] == at_source["meta_info"]["prompt_tokens"] // 16 * 16
    assert logprobs(got) == logprobs(at_source)
    wait_until(lambda: metric(source.runner_get("/metrics"), "kvcr_claims_held") == 0, timeout_s=10,
               message=f"{source.name} holds no claim")


def revoked_claim_comes_back(source: LiveServer, puller: LiveServer, seed: int) -> None:
    """`source` holds 10 pages of the puller's prompt: the puller's hit query claims them, SGLang
    revokes a hit under its 256-token prefetch_threshold, and the revoke hook gives the claim back
    at once (the puller asks long leases); the puller answers as the source would."""
    from kvcr.proto.hints import build_envelope
    from sglang_adapter.cpu_harness.model import prompt_text
    from tests.helpers import wait_until

    def source_metric(name: str) -> float:
        return metric(source.runner_get("/metrics"), name)

    head = prompt_text(seed, 165)
    assert 160 <= serve(source, head)["meta_info"]["prompt_tokens"] < 176  # 10 full pages
    hits = source_metric("kvcr_hits_total")
    text = head + " " + prompt_text(seed + 1, 250)
    got = generate(puller, text, kv_hints=build_envelope(source.endpoints["control"], source.stored_hashes()))
    assert got["meta_info"]["cached_tokens"] == 0
    assert source_metric("kvcr_hits_total") >= hits + 10  # the claim was granted
    wait_until(lambda: source_metric("kvcr_claims_held") == 0, timeout_s=10, message="the revoked claim back")
    assert logprobs(got) == logprobs(generate(source, text))


def on_rank(server, rank: int, text: str) -> dict:
    """A greedy /generate that SGLang's DP controller runs on DP rank `rank`."""
    return generate(server, text, routed_dp_rank=rank)


def rank_stored(server, rank: int) -> set[int]:
    """The block hashes DP rank `rank`'s runner holds in its own tiers."""
    from kvcr.client import ControlClient
    from kvcr.proto.events import RUNNER_MEDIA, BlockStored

    with ControlClient(server.rank(rank)["control"]) as client:
        return {h for e in client.snapshot()[1] if isinstance(e, BlockStored) and e.medium in RUNNER_MEDIA
                for h in e.block_hashes}


def rank_metrics(server, rank: int) -> str:
    import urllib.request

    with urllib.request.urlopen(server.rank(rank)["http"] + "/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.fixture
def live():
    """The helpers live tests share (generate, serve, logprobs, flush, scheduler, pulls_again,
    revoked_claim_comes_back; for DP engines on_rank, rank_stored, rank_metrics)."""
    class Live:
        pass
    h = Live()
    h.generate, h.serve, h.logprobs, h.flush = generate, serve, logprobs, flush
    h.scheduler, h.pulls_again, h.revoked_claim_comes_back = scheduler, pulls_again, revoked_claim_comes_back
    h.on_rank, h.rank_stored, h.rank_metrics = on_rank, rank_stored, rank_metrics
    return h


