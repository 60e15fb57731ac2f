"""The workload driver (`kvcr demo-driver`, its own process): conversations through the router in
parallel, each one's turns in order, every outcome appended to a JSON-lines file the demo reads."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

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
    # SGLang engines only: prompt pages from the engine's own tiers, and whether the token ids the
    # router hashed are the engine's (None: not checked)
    device_pages: int = 0
    host_pages: int = 0
    prompt_ids_match: bool | None = None
    # behind Dynamo: whether Dynamo's router attached a kv_hint (None: our router, not recorded)
    hinted: bool | None = None


class Driver:
    def __init__(self, router_url: str, workers: list[str], conversations: list[Conversation], *,
                 max_tokens: int, concurrency: int, record: Callable[[str, object], None] = lambda kind, v: None
                 ) -> None:
        self.record = record  # called with ("phase", name) and ("outcome", dict), one at a time
        self.url = router_url
        self.workers = workers
        self.max_tokens = max_tokens
        self.concurrency = concurrency
        self.messages = {c.index: [{"role": "system", "content": c.system}] for c in conversations}
        self.served_by: dict[int, list[str]] = {c.index: [] for c in conversations}
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()

    def run(self, phases: list[Phase]) -> list[Outcome]:
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="kvcr-demo-client") as pool:
            for phase in phases:
                self.record("phase", phase.name)
                by_conv: dict[int, list[Step]] = {}
                for step in phase.steps:
                    by_conv.setdefault(step.conversation, []).append(step)
                for future in [pool.submit(self._conversation, phase.name, steps) for steps in by_conv.values()]:
                    future.result()
        return self.outcomes

    def _conversation(self, phase: str, steps: list[Step]) -> None:
        for step in steps:
            outcome = self._send(phase, step)
            with self.lock:
                self.outcomes.append(outcome)
                self.record("outcome", asdict(outcome))

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


class DynamoDriver(Driver):
    """The same conversations through Dynamo's frontend: pins travel as `nvext.backend_instance_id`,
    and what serving each request took is read back from the worker that served it, by the request
    id Dynamo gave it (`chatcmpl-<id>`): Dynamo's responses carry no kvcr fields."""

    def __init__(self, frontend_url: str, workers: dict[str, tuple[str, int]], conversations: list[Conversation], *,
                 model: str, **kwargs) -> None:
        super().__init__(frontend_url, list(workers), conversations, **kwargs)
        self.endpoints = workers  # name -> (worker URL, Dynamo worker id)
        self.model = model

    def _send(self, phase: str, step: Step) -> Outcome:
        messages = self.messages[step.conversation]
        messages.append({"role": "user", "content": step.user})
        pin = pick_pin(step, self.workers, self.served_by[step.conversation])
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "ignore_eos": True,
                **({"nvext": {"backend_instance_id": self.endpoints[pin][1]}} if pin else {})}
        start = time.perf_counter()
        status, _, raw = http(self.url + "/v1/chat/completions", body)
        latency = time.perf_counter() - start
        if status != 200:
            return Outcome(phase, step.conversation, step.turn, "?", pin is not None, 0, 0, 0, 0, 0, None, 0.0, 0.0,
                           latency, None, f"HTTP {status}: {raw[:300]!r}")
        out = json.loads(raw)
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        worker, kv = self._served(out["id"])
        self.served_by[step.conversation].append(worker)
        return Outcome(phase, step.conversation, step.turn, worker, pin is not None, kv["prompt_tokens"],
                       kv["dram_pages"], kv["nvme_pages"], kv["peer_pages"], kv["stored_pages"], kv["source"],
                       kv["prefill_s"], kv["saved_s"], latency, kv["oracle"], hinted=kv["hinted"])

    def _served(self, response_id: str) -> tuple[str, dict]:
        from ..dynamo.local import served_record

        found = served_record({name: url for name, (url, _) in self.endpoints.items()}, response_id)
        if found is None:
            raise RuntimeError(f"no worker served Dynamo's request {response_id}")
        return found
