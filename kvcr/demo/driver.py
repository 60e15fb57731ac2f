"""Runs the workload against the router: conversations in parallel, each one's turns in order."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .httpc import http
from .workload import Conversation, Phase, Step, pick_pin


@dataclass(frozen=True, slots=True)
class Outcome:
    phase: str
    conversation: int
    turn: int
    worker: str
    pinned: bool
    prompt_tokens: int
    dram_pages: int
    nvme_pages: int
    peer_pages: int
    stored_pages: int
    source: str | None
    prefill_s: float
    saved_s: float
    latency_s: float
    oracle: dict | None
    error: str | None = None


class Driver:
    def __init__(self, router_url: str, workers: list[str], conversations: list[Conversation], *,
                 max_tokens: int, concurrency: int) -> None:
        self.url = router_url
        self.workers = workers
        self.max_tokens = max_tokens
        self.concurrency = concurrency
        self.messages = {c.index: [{"role": "system", "content": c.system}] for c in conversations}
        self.served_by: dict[int, list[str]] = {c.index: [] for c in conversations}
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.phase = "starting"

    def run(self, phases: list[Phase]) -> list[Outcome]:
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="kvcr-demo-client") as pool:
            for phase in phases:
                self.phase = phase.name
                by_conv: dict[int, list[Step]] = {}
                for step in phase.steps:
                    by_conv.setdefault(step.conversation, []).append(step)
                for future in [pool.submit(self._conversation, phase.name, steps) for steps in by_conv.values()]:
                    future.result()
        self.phase = "done"
        return self.outcomes

    def _conversation(self, phase: str, steps: list[Step]) -> None:
        for step in steps:
            outcome = self._send(phase, step)
            with self.lock:
                self.outcomes.append(outcome)

    def _send(self, phase: str, step: Step) -> Outcome:
        messages = self.messages[step.conversation]
        messages.append({"role": "user", "content": step.user})
        pin = pick_pin(step, self.workers, self.served_by[step.conversation])
        headers = {"X-KVCR-Target": pin} if pin else {}
        body = {"messages": messages, "max_tokens": self.max_tokens, "kvcr_oracle": True, "ignore_eos": True,
                "rid": f"demo-{step.conversation}-{step.turn}"}
        start = time.perf_counter()
        status, hdrs, raw = http(self.url + "/v1/chat/completions", body, headers)
        latency = time.perf_counter() - start
        if status != 200:
            return Outcome(phase, step.conversation, step.turn, hdrs.get("X-KVCR-Worker", "?"), pin is not None, 0,
                           0, 0, 0, 0, None, 0.0, 0.0, latency, None, f"HTTP {status}: {raw[:300]!r}")
        out = json.loads(raw)
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        worker = hdrs["X-KVCR-Worker"]
        self.served_by[step.conversation].append(worker)
        kv = out["kvcr"]
        return Outcome(phase, step.conversation, step.turn, worker, pin is not None, out["usage"]["prompt_tokens"],
                       kv["dram_pages"], kv["nvme_pages"], kv["peer_pages"], kv["stored_pages"], kv["source"],
                       kv["prefill_s"], kv["saved_s"], latency, kv["oracle"])
