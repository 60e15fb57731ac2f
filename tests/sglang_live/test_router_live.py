"""Live test 3: the reference router (`kvcr router`) in front of two real SGLang engines.

The router finds both engines' in-process runners (no /server_info runner on SGLang: the config
names them), follows their event streams, and tokenizes with the engine's own tokenizer directory.
A conversation's first turn runs on A; while A decodes a long request the router itself booked,
the follow-up goes to B with a hint naming A's pages, and B serves the shared prefix from them
(pulled, not recomputed) with the logprobs of a cold recomputation. The OpenAI routes go through
the same tokenization: the engine's prompt ids are the router's, and the index finds their pages.
"""

from __future__ import annotations

import json
from http.client import HTTPConnection
from urllib.parse import urlsplit

import pytest

from kvcr.client import ControlClient
from kvcr.demo.httpc import get_json, http
from kvcr.proto.events import RUNNER_MEDIA, BlockStored
from kvcr.proto.keys import U64_MASK
from router_hints.scoring import hinted_hashes
from kvcr.text import TextTokenizer, parse_messages
from sglang_adapter.cpu_harness.model import prompt_text
from tests.helpers import wait_until
from tests.sglang_live.helpers import kvcr_router, metric

pytestmark = pytest.mark.live_sglang
PAGE = 16
ARGS = ["--hicache-storage-prefetch-policy", "wait_complete", "--enable-cache-report"]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(engines, tiny_model, tmp_path_factory):
    a, b = engines("router-A", "router-B", args=ARGS)
    # A's runner by its HTTP info endpoint, B's by its control socket: both discovery paths.
    front = kvcr_router(tmp_path_factory.mktemp("router"), tiny_model, [
        {"name": a.name, "url": a.url, "runner": a.runner_http, "engine": "sglang"},
        {"name": b.name, "url": b.url, "runner": b.endpoints["control"], "engine": "sglang"}])
    try:
        yield front, a, b, TextTokenizer(tiny_model)
    finally:
        front.stop()


def post(url: str, path: str, body: dict, target: str | None = None) -> tuple[str | None, dict]:
    status, headers, raw = http(url + path, body, {"X-KVCR-Target": target} if target else None)
    assert status == 200, raw[-2000:]
    return headers.get("X-KVCR-Worker"), json.loads(raw)


def generate_body(text: str, max_new_tokens: int = 4, **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY}, "return_logprob": True,
            "return_prompt_token_ids": True, **extra}


def logprobs(response: dict) -> list[tuple[float, int]]:
    return [(round(lp, 4), tok) for lp, tok, *_ in response["meta_info"]["output_token_logprobs"]]


def assert_same_answer(got: dict, cold: dict) -> None:
    """The same tokens with logprobs within 1e-4: a prefill over a pulled prefix against a one-shot
    prefill runs other shapes, and rounding both to 4 places split -5.80235 once in a full run."""
    ours, theirs = (r["meta_info"]["output_token_logprobs"] for r in (got, cold))
    assert [t for _, t, *_ in ours] == [t for _, t, *_ in theirs]
    assert [lp for lp, *_ in ours] == pytest.approx([lp for lp, *_ in theirs], abs=1e-4)


def debug(front, body: dict, route: str = "generate") -> dict:
    status, _, raw = http(f"{front.url}/debug/index?route={route}", body)
    assert status == 200, raw
    view = json.loads(raw)
    view["by_worker"] = {row["worker"]: row for row in view["workers"]}
    return view


def depth(view: dict, worker: str) -> int:
    return sum(view["by_worker"][worker]["overlap"].values())


def runner_hashes(server) -> set[int]:
    with ControlClient(server.endpoints["control"]) as client:
        return {h & U64_MASK for e in client.snapshot()[1] if isinstance(e, BlockStored) and e.medium in RUNNER_MEDIA
                for h in e.block_hashes}


def load(front, worker: str) -> dict:
    return next(w["load"] for w in get_json(front.url + "/workers") if w["name"] == worker)


IDLE = {"active_prefill_tokens": 0, "active_prefill_blocks": 0, "potential_decode_blocks": 0, "active_requests": 0}


class HeldStream:
    """A streaming /generate through the router, kept open until closed (the engine aborts it then)."""

    def __init__(self, url: str, body: dict, target: str) -> None:
        parts = urlsplit(url)
        self.conn = HTTPConnection(parts.hostname, parts.port, timeout=120)
        self.conn.request("POST", "/generate", json.dumps(body),
                          {"Content-Type": "application/json", "X-KVCR-Target": target})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()[-2000:]
        self.worker = self.resp.getheader("X-KVCR-Worker")

    def next_event(self) -> dict:
        while True:
            line = self.resp.readline()
            assert line, "the held stream ended early"
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                return json.loads(line[len(b"data: "):])

    def close(self) -> None:
        self.resp.close()
        self.conn.close()


def test_the_follow_up_goes_to_the_idle_engine_with_a_hint_and_is_served_from_the_peers_pages(cluster):
    front, a, b, tok = cluster
    turn1 = prompt_text(301, 400)
    turn2 = turn1 + " " + prompt_text(302, 120)

    # First turn, pinned to A: cold (nobody holds a page of it), A computes and backs it up.
    worker, first = post(front.url, "/generate", generate_body(turn1), target=a.name)
    assert worker == a.name
    assert first["meta_info"]["cached_tokens"] == 0
    ids1 = first["prompt_token_ids"]
    assert ids1 == tok.encode(turn1) and ids1[0] == tok.bos_id  # the engine's ids are the router's
    shared = len(ids1) // PAGE  # the full pages turn 2 shares with turn 1
    assert shared * PAGE >= 256  # above SGLang's prefetch threshold
    ids2 = tok.encode(turn2)
    assert ids2[:len(ids1)] == ids1

    # The router indexes A's pages from A's runner's stream (the engine's hashes, matched by content).
    view = wait_until(lambda: depth(v := debug(front, {"text": turn2}), a.name) == shared and v, timeout_s=30,
                      message="router indexed A's turn-1 pages")
    assert view["tokens"] == len(ids2) and view["request_blocks"] == len(ids2) // PAGE
    assert view["choice"]["worker"] == a.name and view["hint"] is None  # A idle: its cache wins

    # A is loaded: a long streaming request on another prompt, which the router itself books,
    # pinned to A, decoding (one sharing turn 1's prefix would add only its tail to A's load).
    held_text = prompt_text(303, 600)
    held_blocks = len(tok.encode(held_text)) // PAGE
    held_body = {"text": held_text, "sampling_params": {"max_new_tokens": 3200, **GREEDY}, "stream": True}
    held = HeldStream(front.url, held_body, a.name)
    try:
        assert held.worker == a.name
        held.next_event()  # a token arrived: the router moved its booking from prefill to decode
        wait_until(lambda: load(front, a.name) == {**IDLE, "potential_decode_blocks": held_blocks,
                                                   "active_requests": 1},
                   timeout_s=10, message="the router booked the held request on A")
        # Dynamo's cost: A's device credit for the prefix it holds (shared) is less than the
        # distinct decode blocks the held request books there (held_blocks > shared): idle B is cheaper.
        view = debug(front, {"text": turn2})
        assert view["choice"]["worker"] == b.name
        assert depth(view, a.name) == shared and depth(view, b.name) == 0
        hint = view["hint"]
        assert hint["actions"][0]["payload"]["source_control_endpoint"] == a.endpoints["control"]
        assert len(hinted_hashes(hint)) == shared and set(hinted_hashes(hint)) <= runner_hashes(a)

        # The follow-up, not pinned: the router sends it to B with the hint (attached and posted).
        worker, pulled = post(front.url, "/generate", generate_body(turn2))
        assert worker == b.name
        assert held.next_event()["meta_info"]["completion_tokens"] >= 1  # A was still decoding it
    finally:
        held.close()
    meta = pulled["meta_info"]
    assert pulled["prompt_token_ids"] == ids2
    assert meta["cached_tokens"] == shared * PAGE
    assert meta["cached_tokens_details"]["storage"] == shared * PAGE
    assert meta["cached_tokens_details"]["storage_backend"] == "KVCRStorage"
    wait_until(lambda: load(front, a.name) == IDLE, timeout_s=60,
               message="the router released the held request's load when its client left")

    wait_until(lambda: metric(a.runner_get("/metrics"), "kvcr_claims_held") == 0, timeout_s=15,
               message="A's claims released")
    assert metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total") == shared
    router_metrics = http(front.url + "/metrics")[2].decode()
    for outcome in ("issued", "posted", "attached"):  # the follow-up's hint, and only it
        assert metric(router_metrics, "kvcr_router_hints_total", outcome=outcome) == 1
    assert metric(router_metrics, "kvcr_router_decisions_total", worker=b.name, route="generate") == 1
    assert "kvcr_router_upstream_errors_total{" not in router_metrics  # the held client's leaving is no failure

    # B backs up what it pulled and computed: the router's index now holds turn 2 on both engines.
    view = wait_until(lambda: depth(v := debug(front, {"text": turn2}), b.name) == v["request_blocks"] and v,
                      timeout_s=30, message="router indexed B's turn-2 pages")
    assert depth(view, a.name) == shared
    assert view["choice"]["worker"] == b.name and view["hint"] is None

    # A cold recomputation of turn 2 (a cache namespace nobody holds a page of) answers as B did.
    cold = a.post("/generate", generate_body(turn2, cache_salt="cold-recompute"))
    assert cold["meta_info"]["cached_tokens"] == 0 and cold["prompt_token_ids"] == ids2
    assert pulled["output_ids"] == cold["output_ids"]
    assert_same_answer(pulled, cold)


def test_openai_prompts_are_tokenized_as_the_engine_does_and_their_pages_are_found(cluster):
    front, a, b, tok = cluster
    system = prompt_text(401, 380)
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": prompt_text(402, 20)}]
    chat1 = {"messages": turn1, "max_tokens": 4, **GREEDY, "return_prompt_token_ids": True}
    worker, out = post(front.url, "/v1/chat/completions", chat1, target=a.name)
    assert worker == a.name
    ids1 = out["choices"][0]["prompt_token_ids"]
    assert ids1 == tok.chat_ids(parse_messages(turn1)) and ids1.count(tok.bos_id) == 1
    assert out["usage"]["prompt_tokens"] == len(ids1)
    assert debug(front, chat1, "chat")["tokens"] == len(ids1)
    shared = len(ids1) // PAGE

    turn2 = [*turn1, {"role": "assistant", "content": prompt_text(403, 10)},
             {"role": "user", "content": prompt_text(404, 30)}]
    chat2 = {"messages": turn2, "max_tokens": 4, **GREEDY, "logprobs": True, "return_prompt_token_ids": True}
    ids2 = tok.chat_ids(parse_messages(turn2))
    assert ids2[:len(ids1)] == ids1
    # Pages the engine hashed from its own chat ids are found from the router's: the ids agree.
    view = wait_until(lambda: depth(v := debug(front, chat2, "chat"), a.name) == shared and v, timeout_s=30,
                      message="router indexed A's chat pages")
    assert view["tokens"] == len(ids2)

    # Pinned to B, the chat still gets the hint: posted to B's runner (chat bodies carry none).
    pulled_before = metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total")
    posted_before = metric(http(front.url + "/metrics")[2].decode(), "kvcr_router_hints_total", outcome="posted")
    worker, pulled = post(front.url, "/v1/chat/completions", chat2, target=b.name)
    assert worker == b.name
    assert pulled["choices"][0]["prompt_token_ids"] == ids2
    assert pulled["usage"]["prompt_tokens_details"]["cached_tokens"] == shared * PAGE
    assert metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total") - pulled_before == shared
    assert metric(http(front.url + "/metrics")[2].decode(), "kvcr_router_hints_total",
                  outcome="posted") == posted_before + 1
    cold = a.post("/v1/chat/completions", {**chat2, "cache_salt": "cold-chat"})
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert [round(t["logprob"], 4) for t in pulled["choices"][0]["logprobs"]["content"]] == \
        [round(t["logprob"], 4) for t in cold["choices"][0]["logprobs"]["content"]]
    wait_until(lambda: metric(a.runner_get("/metrics"), "kvcr_claims_held") == 0, timeout_s=15,
               message="A's claims released")

    # A text completion through the router: the engine's prompt ids are the router's too.
    prompt = prompt_text(405, 300)
    completion = {"prompt": prompt, "max_tokens": 2, **GREEDY, "return_token_ids": True}
    worker, out = post(front.url, "/v1/completions", completion)
    ids = out["choices"][0]["prompt_token_ids"]
    assert ids == tok.encode(prompt) and debug(front, completion, "completions")["tokens"] == len(ids)
    wait_until(lambda: depth(debug(front, completion, "completions"), worker) == len(ids) // PAGE, timeout_s=30,
               message=f"router indexed {worker}'s completion pages")



def salted_on_a(cluster, seed: int, salt: str) -> tuple[str, int, dict]:
    """A prompt A computed under `salt`, once the router indexed it: (text, full pages, A's answer)."""
    front, a, b, tok = cluster
    text = prompt_text(seed, 400)
    shared = len(tok.encode(text)) // PAGE
    worker, first = post(front.url, "/generate", generate_body(text, cache_salt=salt), target=a.name)
    assert worker == a.name and first["meta_info"]["cached_tokens"] == 0
    wait_until(lambda: depth(debug(front, {"text": text, "cache_salt": salt}), a.name) == shared,
               timeout_s=30, message=f"router indexed A's {salt} pages")
    return text, shared, first


def test_a_tenants_pages_are_never_hinted_or_pulled_for_another_cache_namespace(cluster):
    """Tenant isolation across peers: A holds a prompt under one salt; the same prompt under
    another salt, or none, matches none of A's pages in the router, gets no hint, and B finds no hit."""
    front, a, b, tok = cluster
    text, _, _ = salted_on_a(cluster, 501, "tenant-a")
    pulled_before = metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total")
    for other in ({"cache_salt": "tenant-b"}, {}):
        view = debug(front, {"text": text, **other})
        assert depth(view, a.name) == 0 and view["hint"] is None, f"A's pages matched {other or 'no salt'}"
        worker, answer = post(front.url, "/generate", generate_body(text, **other), target=b.name)
        assert worker == b.name and answer["meta_info"]["cached_tokens"] == 0, f"a hit for {other or 'no salt'}"
    assert metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total") == pulled_before


def test_the_same_salt_pulls_a_peers_pages_on_the_routers_hint(cluster):
    """The hint names A's salted event hashes, B's lookup is asked for salted storage keys: the
    request's tokens join the two, so B pulls A's pages and answers as A did."""
    front, a, b, tok = cluster
    text, shared, first = salted_on_a(cluster, 502, "tenant-c")
    assert debug(front, {"text": text, "cache_salt": "tenant-c"})["hint"] is None  # A idle: A itself wins
    pulled_before = metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total")
    worker, same = post(front.url, "/generate", generate_body(text, cache_salt="tenant-c"), target=b.name)
    assert worker == b.name and same["meta_info"]["cached_tokens"] == shared * PAGE
    assert metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total") - pulled_before == shared
    assert logprobs(same) == logprobs(first)
