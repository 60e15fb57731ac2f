"""The workload driver on live SGLang engines (`kvcr demo-driver --engine sglang`).

Each turn goes through the router to an engine's `/v1/chat/completions` (greedy, with logprobs and
SGLang's meta_info: prompt and output token ids, `cached_tokens_details`). Then:

- pages by source: SGLang's own tiers from `cached_tokens_details` (device, host; storage is kvcr),
  and the storage part split with the serving engine's runner counters read around the request
  (`kvcr_pulled_pages_total`: from a peer; `kvcr_promoted_pages_total`: from its NVMe; the rest
  from its DRAM). The source is the peer runner whose `kvcr_hits_total` moved. Requests go one
  at a time, so these deltas are exactly this request's;
- the oracle: an answer with cached tokens is recomputed cold on the reference engine
  (`--disable-radix-cache`, no hierarchical cache) from the engine's own prompt token ids; the
  output token ids, their logprobs and the top logprobs must be bitwise equal (one request at a
  time on both engines, so no batching differs either);
- the prompt ids the router hashed (the same tokenizer directory and code) must be the engine's;
- the next turn waits (at most BACKUP_WAIT_S) until the router's index shows the engine's backup
  of this turn's pages, so where the next turn finds them does not depend on timing.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Callable

from .driver import Driver, Outcome
from .httpc import http
from .workload import Conversation, Step, pick_pin

TOP_LOGPROBS = 5
# |Δ logprob|. The engine's logits are bf16: this model's top logits (6-8) round in steps of 1/32 (1/16
# up to 16), and a step moves a logprob by up to that; a wrong prompt token moves them 1.6-2.2 (docs/demo.md).
ORACLE_TOLERANCE = 0.1
BACKUP_WAIT_S = 10.0
COUNTERS = {"pulled": "kvcr_pulled_pages_total", "promoted": "kvcr_promoted_pages_total",
            "hits": "kvcr_hits_total"}


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus text metric's samples carrying `labels` (0 when there is none)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{") and all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


def runner_metrics(url: str) -> str:
    status, _, body = http(url.rstrip("/") + "/metrics", timeout_s=10.0)
    if status != 200:
        raise OSError(f"GET {url}/metrics: HTTP {status}")
    return body.decode()


def _logprobs(meta: dict) -> list[tuple[float, int]]:
    return [(lp, tok) for lp, tok, *_ in meta.get("output_token_logprobs") or []]


def _top(meta: dict) -> list[list[float]]:
    """Per output position, the top logprobs by rank (values only: near-ties may swap ids)."""
    return [[lp for lp, *_ in pos or []] for pos in meta.get("output_top_logprobs") or []]


def compare(meta: dict, output_ids: list[int], ref: dict) -> dict:
    """The oracle's verdict on one answer against the reference's /generate response: the same
    output token ids, and every logprob (chosen and top by rank) within ORACLE_TOLERANCE."""
    mine, theirs = _logprobs(meta), _logprobs(ref["meta_info"])
    top_mine, top_theirs = _top(meta), _top(ref["meta_info"])
    ids_equal = output_ids == ref["output_ids"] and len(mine) == len(theirs) == len(output_ids)
    deltas = [abs(a[0] - b[0]) for a, b in zip(mine, theirs)]
    deltas += [abs(a - b) for pa, pb in zip(top_mine, top_theirs) for a, b in zip(pa, pb)]
    shape_equal = len(top_mine) == len(top_theirs) and all(len(a) == len(b) for a, b in zip(top_mine, top_theirs))
    max_abs = max(deltas, default=0.0)
    return {"ok": ids_equal and shape_equal and max_abs <= ORACLE_TOLERANCE, "output_ids_equal": ids_equal,
            "bitwise_equal": ids_equal and mine == theirs and top_mine == top_theirs,
            "top_logprobs": TOP_LOGPROBS, "max_abs_logprob": max_abs,
            "cached_tokens": meta.get("cached_tokens", 0), "output_tokens": len(output_ids)}


class SGLangDriver(Driver):
    def __init__(self, router_url: str, workers: list[str], conversations: list[Conversation], *, max_tokens: int,
                 reference: str, runners: dict[str, str], tokenizer: str, page_size: int,
                 record: Callable[[str, object], None] = lambda kind, v: None) -> None:
        from ..text import TextTokenizer

        # one request at a time: the runner counters read around it are its own, and neither
        # engine batches it with another (batching would change the arithmetic)
        super().__init__(router_url, workers, conversations, max_tokens=max_tokens, concurrency=1, record=record)
        self.reference = reference.rstrip("/")
        self.runners = runners
        self.page_size = page_size
        self.tokenizer = TextTokenizer(tokenizer)
        self.controlled = False

    @classmethod
    def from_args(cls, args, workers: list[str], conversations: list[Conversation],
                  record: Callable[[str, object], None]) -> "SGLangDriver":
        if not (args.reference and args.runners and args.tokenizer):
            raise SystemExit("kvcr demo-driver --engine sglang needs --reference, --runners and --tokenizer")
        runners = dict(item.split("=", 1) for item in args.runners.split(","))
        return cls(args.router, workers, conversations, max_tokens=args.max_tokens, reference=args.reference,
                   runners=runners, tokenizer=args.tokenizer, page_size=args.page_size, record=record)

    def counters(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, url in self.runners.items():
            text = runner_metrics(url)
            out[name] = {key: metric(text, m) for key, m in COUNTERS.items()}
        return out

    def _failed(self, phase: str, step: Step, worker: str, pinned: bool, latency: float, error: str) -> Outcome:
        return Outcome(phase, step.conversation, step.turn, worker, pinned, 0, 0, 0, 0, 0, None, 0.0, 0.0, latency,
                       None, error)

    def _send(self, phase: str, step: Step) -> Outcome:
        from ..text import parse_messages

        messages = self.messages[step.conversation]
        messages.append({"role": "user", "content": step.user})
        pin = pick_pin(step, self.workers, self.served_by[step.conversation])
        headers = {"X-KVCR-Target": pin} if pin else {}
        body = {"messages": messages, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "logprobs": True, "top_logprobs": TOP_LOGPROBS, "return_meta_info": True, "return_token_ids": True,
                "return_cached_tokens_details": True, "rid": f"demo-{step.conversation}-{step.turn}"}
        router_ids = self.tokenizer.chat_ids(parse_messages(messages))  # what the router hashes
        before = self.counters()
        start = time.perf_counter()
        status, hdrs, raw = http(self.url + "/v1/chat/completions", body, headers)
        latency = time.perf_counter() - start
        worker = hdrs.get("X-KVCR-Worker", "?")
        if status != 200:
            return self._failed(phase, step, worker, pin is not None, latency, f"HTTP {status}: {raw[:300]!r}")
        after = self.counters()
        choice = json.loads(raw)["choices"][0]
        meta = choice["meta_info"]
        messages.append({"role": "assistant", "content": choice["message"]["content"]})
        self.served_by[step.conversation].append(worker)
        prompt_ids, output_ids = choice["prompt_token_ids"], choice["response_token_ids"]

        ps = self.page_size
        details = meta.get("cached_tokens_details") or {}
        cached = meta.get("cached_tokens", 0) // ps
        host, storage = (int(details.get(k) or 0) // ps for k in ("host", "storage"))
        device = cached - host - storage
        moved = {k: after[worker][k] - before[worker][k] for k in COUNTERS}
        peer = min(int(moved["pulled"]), storage)
        nvme = min(int(moved["promoted"]), storage - peer)
        dram = storage - peer - nvme
        source = None
        if peer:
            source = ",".join(n for n in self.runners if n != worker and after[n]["hits"] > before[n]["hits"]) or None

        oracle, saved = None, 0.0
        if cached:
            try:
                oracle, cold_s = self._check(prompt_ids, output_ids, meta)
            except (OSError, ValueError, KeyError) as exc:
                return self._failed(phase, step, worker, pin is not None, latency, f"oracle: {exc!r}")
            saved = cold_s - meta.get("e2e_latency", 0.0)
        depth = self._wait_for_backup(worker, prompt_ids + output_ids[:-1])
        return Outcome(phase, step.conversation, step.turn, worker, pin is not None, len(prompt_ids), dram, nvme,
                       peer, max(0, depth - cached), source, 0.0, saved, latency, oracle, None, device, host,
                       router_ids == prompt_ids)

    def _cold(self, prompt_ids: list[int]) -> dict:
        body = {"input_ids": prompt_ids, "return_logprob": True, "top_logprobs_num": TOP_LOGPROBS,
                "sampling_params": {"max_new_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}}
        status, _, raw = http(self.reference + "/generate", body)
        if status != 200:
            raise OSError(f"reference engine: HTTP {status}: {raw[:300]!r}")
        ref = json.loads(raw)
        if ref["meta_info"].get("cached_tokens"):
            raise ValueError(f"the reference engine reused {ref['meta_info']['cached_tokens']} cached tokens")
        return ref

    def _check(self, prompt_ids: list[int], output_ids: list[int], meta: dict) -> tuple[dict, float]:
        """The same prompt ids, cold, on the reference engine; returns the verdict and its latency."""
        ref = self._cold(prompt_ids)
        if not self.controlled:
            self._control(prompt_ids, ref)
        return compare(meta, output_ids, ref), ref["meta_info"].get("e2e_latency", 0.0)

    def _control(self, prompt_ids: list[int], ref: dict) -> None:
        """Once: the oracle's teeth. The prompt with one early token changed (as a wrong byte in the
        first cached page would), cold: the verdict against the true answer must be a mismatch."""
        self.controlled = True
        changed = list(prompt_ids)
        first = 2  # ids 0 and 1 are BOS and EOS
        changed[1] = first + (changed[1] - first + 1) % (self.tokenizer.vocab_size - first)
        other = self._cold(changed)
        verdict = compare(other["meta_info"], other["output_ids"], ref)
        with self.lock:
            self.record("control", {"changed_position": 1, "detected": not verdict["ok"],
                                    "output_ids_changed": not verdict["output_ids_equal"],
                                    "max_abs_logprob": verdict["max_abs_logprob"], "tolerance": ORACLE_TOLERANCE})

    def _depth(self, worker: str, ids: list[int]) -> int:
        """Leading pages of `ids` the router's index holds in `worker`'s runner (its backup)."""
        status, _, raw = http(self.url + "/debug/index?route=generate", {"input_ids": ids}, timeout_s=10.0)
        if status != 200:
            raise OSError(f"router /debug/index: HTTP {status}: {raw[:300]!r}")
        rows = [r for r in json.loads(raw)["workers"] if r["worker"] == worker]
        return rows[0]["runner"] if rows else 0

    def _wait_for_backup(self, worker: str, ids: list[int]) -> int:
        want = len(ids) // self.page_size
        deadline = time.monotonic() + BACKUP_WAIT_S
        while (depth := self._depth(worker, ids)) < want:
            if time.monotonic() > deadline:
                print(f"kvcr demo-driver: {worker} announced {depth} of {want} pages within {BACKUP_WAIT_S:.0f} s; "
                      "going on", file=sys.stderr, flush=True)
                break
            time.sleep(0.05)
        return depth
