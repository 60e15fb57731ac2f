"""The worker's serving loop: find the cached prefix (local DRAM, NVMe, or a hinted peer), prefill
the rest, store the new pages in the runner (which announces them), then decode greedily."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Iterator

import torch

from ..proto.pull import PeerError
from ..proto.announce import Announce, announce_request
from ..proto.hints import FetchHint
from ..proto.keys import U64_MASK, request_page_hashes
from ..proto.pool import PoolError
from ..peer_pulls import PeerPulls
from ..runner import TIER_DRAM, TIER_NVME, Runner
from .model import KV, TinyLM, pack_pages, unpack_pages

POOL = "kv"
log = logging.getLogger(__name__)
ORACLE_TOLERANCE = 1e-4  # max |logit difference| allowed between chunked and one-shot fp32 prefill


@dataclass(frozen=True, slots=True)
class Oracle:
    """The served logits against a local cold run: bitwise with the same chunking, and one-shot."""

    chunked_equal: bool
    full_max_abs: float

    @property
    def ok(self) -> bool:
        return self.chunked_equal and self.full_max_abs <= ORACLE_TOLERANCE


@dataclass(frozen=True, slots=True)
class PrefillInfo:
    prompt_tokens: int
    dram_pages: int
    nvme_pages: int
    peer_pages: int
    stored_pages: int
    prefill_s: float
    saved_s: float
    source: str | None
    oracle: Oracle | None

    def cached_tokens(self, page_size: int) -> int:
        return (self.dram_pages + self.nvme_pages + self.peer_pages) * page_size


@dataclass
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    dram_pages: int = 0
    nvme_pages: int = 0
    peer_pages: int = 0
    stored_pages: int = 0
    prefill_s: float = 0.0
    saved_s: float = 0.0
    oracle_checks: int = 0
    oracle_mismatches: int = 0
    store_failures: int = 0
    hint_errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, info: PrefillInfo) -> None:
        with self.lock:
            self.requests += 1
            self.prompt_tokens += info.prompt_tokens
            self.dram_pages += info.dram_pages
            self.nvme_pages += info.nvme_pages
            self.peer_pages += info.peer_pages
            self.stored_pages += info.stored_pages
            self.prefill_s += info.prefill_s
            self.saved_s += info.saved_s
            if info.oracle is not None:
                self.oracle_checks += 1
                self.oracle_mismatches += not info.oracle.ok

    def as_dict(self) -> dict:
        with self.lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


class Engine:
    def __init__(self, model: TinyLM, runner: Runner, pulls: PeerPulls, page_size: int) -> None:
        self.model = model
        self.runner = runner
        self.pulls = pulls
        self.page_size = page_size
        self.stats = EngineStats()
        self._s_per_token = 0.0  # EWMA of prefill seconds per computed token, for "time saved"

    def _pull(self, announces: list[Announce], hexes: list[str], have: int, hint: FetchHint | None
              ) -> tuple[int, str | None]:
        """Pull pages [have, n) from the hinted peer; returns the leading local count and the source."""
        events = [a.event_hash & U64_MASK for a in announces]
        if hint is not None:
            depth = next((i for i, (a, b) in enumerate(zip(events, hint.block_hashes)) if a != b),
                         min(len(events), len(hint.block_hashes)))
            endpoint = hint.source_control_endpoint
        else:
            posted = self.pulls.hinted_source(events)
            depth, endpoint = (posted.num_pages, posted.endpoint) if posted is not None else (0, "")
        if depth <= have:
            return have, None
        try:
            return self.pulls.pull_from(endpoint, POOL, hexes[:depth]), endpoint
        except PeerError as exc:  # an untrusted source, or another model's pages: compute instead
            log.warning("hint ignored: %s", exc)
            with self.stats.lock:
                self.stats.hint_errors += 1
            return have, None

    def _load(self, keys: list[str], n: int) -> tuple[int, KV | None]:
        if n == 0:
            return 0, None
        cfg = self.model.cfg
        pages = torch.empty(n, cfg.layers, 2, self.page_size, cfg.hidden, dtype=torch.float32)
        views = [memoryview(pages[i].numpy()).cast("B") for i in range(n)]
        got = self.runner.read_into(POOL, keys[:n], views)  # fewer if a page was evicted meanwhile
        return got, unpack_pages(pages[:got]) if got else None

    def prefill(self, tokens: list[int], *, hint: FetchHint | None = None, oracle: bool = False,
                cache_salt: str | None = None) -> tuple[torch.Tensor, KV, PrefillInfo]:
        """`cache_salt` seeds both chains as SGLang's do: another tenant's request makes other keys."""
        p = self.page_size
        full = len(tokens) // p
        usable = (len(tokens) - 1) // p  # at least one token is always computed
        hexes = request_page_hashes(tokens[:full * p], p, cache_salt=cache_salt)
        keys = self.runner.keys(POOL, hexes)
        # what peers and routers know the pages by
        announces = announce_request(tokens, p, num_pages=full, cache_salt=cache_salt)
        tiers = self.runner.tiers(POOL, keys[:usable])
        have = next((i for i, t in enumerate(tiers) if t not in (TIER_DRAM, TIER_NVME)), usable)
        source = None
        local = have
        if have < usable:
            local, source = self._pull(announces[:usable], hexes, have, hint)
        start = time.perf_counter()
        got, past = self._load(keys, min(local, usable))
        logits, kv = self.model.prefill(tokens, p, past, got * p)
        elapsed = time.perf_counter() - start
        computed = len(tokens) - got * p
        if computed >= 4 * p:  # short tails cost more per token than a prefix would have
            rate = elapsed / computed
            self._s_per_token = 0.8 * self._s_per_token + 0.2 * rate if self._s_per_token else rate
        stored = self._store(kv, keys, announces, got, full)
        dram = min(got, sum(t == TIER_DRAM for t in tiers[:have]))
        nvme = min(got - dram, have - dram)
        info = PrefillInfo(len(tokens), dram, nvme, max(0, got - have), stored, elapsed,
                           got * p * self._s_per_token, source if got > have else None,
                           self._oracle(tokens, logits) if oracle and got else None)
        self.stats.add(info)
        return logits, kv, info

    def _store(self, kv: KV, keys: list[str], announces: list[Announce], first: int, full: int) -> int:
        """Back up the new pages (at most half the pool per request); a full pool costs the backup,
        never the request."""
        full = min(full, first + max(1, self.runner.capacity(POOL) // 2))
        if first >= full:
            return 0
        packed = pack_pages(kv, first, full - first, self.page_size)
        pages = [memoryview(packed[i].numpy()).cast("B") for i in range(full - first)]
        try:
            return self.runner.put(POOL, keys[first:full], pages, announces[first:full])
        except PoolError as exc:
            log.warning("pages not stored: %s", exc)
            with self.stats.lock:
                self.stats.store_failures += 1
            return 0

    def _oracle(self, tokens: list[int], served: torch.Tensor) -> Oracle:
        cold, _ = self.model.prefill(tokens, self.page_size)
        one_shot, _ = self.model.forward(tokens, 0, None)
        return Oracle(bool(torch.equal(cold, served)), float((one_shot[-1] - served).abs().max()))

    def generate(self, tokens: list[int], max_new_tokens: int, *, hint: FetchHint | None = None,
                 oracle: bool = False, stop_ids: frozenset[int] = frozenset(),
                 cache_salt: str | None = None) -> tuple[PrefillInfo, Iterator[int]]:
        """Prefill now; the returned iterator decodes greedily, one token per step."""
        logits, kv, info = self.prefill(tokens, hint=hint, oracle=oracle, cache_salt=cache_salt)

        def steps() -> Iterator[int]:
            nonlocal logits, kv
            pos = len(tokens)
            for i in range(max_new_tokens):
                token = int(torch.argmax(logits))
                with self.stats.lock:
                    self.stats.generated_tokens += 1
                yield token
                if token in stop_ids or i + 1 == max_new_tokens:
                    return
                out, kv = self.model.forward([token], pos, kv)
                logits = out[-1]
                pos += 1

        return info, steps()
