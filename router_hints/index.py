"""Inventory index: which worker (and DP rank) holds which block in which tier. Pure.

Fed decoded event batches (any publisher: engines, our runners); answers, per worker, how deep a
request's prefix is held on device, then continued through host DRAM, then disk — Dynamo's
semantics. Blocks are matched by content: like Dynamo's router we recompute a hash from each
stored block's tokens (XXH3, salted by LoRA name and cache namespace) and chain it with its
parent's, so engines with different event hash schemes still match the same prompt. The
engine's own hash is kept per worker as an identity for parent links, removals and hints.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from kvcr.proto.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcr.proto.keys import U64_MASK
from kvcr.proto.tokenhash import dynamo_chain_hash, dynamo_local_block_hashes, dynamo_sequence_hashes

TIERS = ("device", "host", "disk")
_MEDIUM_TIER = {None: "device", "GPU": "device", "DEVICE": "device",
                "CPU": "host", "CPU_PINNED": "host", "CPU_TIER1": "host",
                "CPU_TIER2": "disk", "DISK": "disk", "NVME": "disk", "STORAGE": "disk",
                "EXTERNAL": "disk", "SHARED": "disk", "REMOTE": "disk", "NETWORK": "disk"}

Worker = tuple[str, int]  # (worker id, DP rank)
# The tier classes matching walks (device; device or host; anywhere), and which hold each tier.
_TIERS_IN = (("device",), ("device", "host"), ("device", "host", "disk"))
_CLASSES_OF = {tier: tuple(i for i, tiers in enumerate(_TIERS_IN) if tier in tiers) for tier in TIERS}


@dataclass(frozen=True, slots=True)
class Overlap:
    """Leading blocks of a request a worker holds: on device, then host, then disk."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def depth(self) -> int:
        return self.device + self.host + self.disk


@dataclass
class _Held:
    external: int                    # the publisher's own hash (u64) for this block
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # tier -> refcount


@dataclass
class _WorkerState:
    # engine hash (u64) -> our content sequence hash, per tier refcounts are on the sequence entry
    by_external: dict[int, int] = field(default_factory=dict)
    held: dict[int, _Held] = field(default_factory=dict)  # sequence hash -> what this worker holds


@dataclass
class InventoryIndex:
    block_size: int
    num_events: int = 0
    num_ignored: int = 0          # events a router must drop (unknown medium, wrong block size ...)
    num_unknown_parent: int = 0
    _workers: dict[Worker, _WorkerState] = field(default_factory=dict)
    # Matching walks a request once per tier class with one integer AND per block: every worker
    # gets a bit, and each block a mask of the workers holding it on device / device or host / anywhere.
    _bits: dict[Worker, int] = field(default_factory=dict)
    _free_bits: list[int] = field(default_factory=list)
    _next_bit: int = 0
    _masks: tuple[dict[int, int], dict[int, int], dict[int, int]] = field(
        default_factory=lambda: ({}, {}, {}))

    # --- ingest -----------------------------------------------------------------------------

    def apply(self, worker_id: str, batch: EventBatch, dp_rank: int = 0) -> None:
        """Apply one decoded batch from (worker_id, dp_rank); a non-nil batch dp_rank wins."""
        worker = (worker_id, batch.dp_rank if batch.dp_rank is not None else dp_rank)
        state = self._workers.setdefault(worker, _WorkerState())
        for event in batch.events:
            self.num_events += 1
            if isinstance(event, BlockStored):
                self._stored(worker, state, event)
            elif isinstance(event, BlockRemoved):
                self._removed(worker, state, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear(worker)
                state = self._workers.setdefault(worker, _WorkerState())  # later events start afresh

    def _stored(self, worker: Worker, state: _WorkerState, event: BlockStored) -> None:
        tier = _MEDIUM_TIER.get(event.medium)
        if tier is None or event.block_size != self.block_size or _router_drops(event):
            self.num_ignored += 1
            return
        parent_seq = None
        if event.parent_block_hash is not None:
            parent_seq = state.by_external.get(event.parent_block_hash & U64_MASK)
            if parent_seq is None:
                self.num_unknown_parent += 1
                return
        local = dynamo_local_block_hashes(event.token_ids[:self.block_size * len(event.block_hashes)],
                                          self.block_size, lora_name=event.lora_name,
                                          cache_namespace=event.cache_salt or _vllm_salt(event))
        bit = self._bit(worker)
        by_external, holding = state.by_external, state.held
        for external, content in zip(event.block_hashes, local):
            seq = content if parent_seq is None else dynamo_chain_hash(parent_seq, content)
            external &= U64_MASK
            by_external[external] = seq
            held = holding.get(seq)
            if held is None:
                held = holding[seq] = _Held(external)
            counts = held.counts
            if not counts[tier]:
                self._tier_added(bit, seq, tier)
            counts[tier] += 1
            parent_seq = seq

    def _removed(self, worker: Worker, state: _WorkerState, event: BlockRemoved) -> None:
        tier = _MEDIUM_TIER.get(event.medium)
        if tier is None:
            self.num_ignored += 1
            return
        bit = self._bits.get(worker)
        by_external, holding = state.by_external, state.held
        for external in event.block_hashes:
            external &= U64_MASK
            seq = by_external.get(external)
            held = holding.get(seq) if seq is not None else None
            left = held.counts.get(tier, 0) - 1 if held is not None else -1
            if left < 0:
                continue
            held.counts[tier] = left
            if left:
                continue
            self._tier_dropped(bit, seq, held, tier)
            if not any(held.counts.values()):
                del holding[seq]
                del by_external[external]

    def clear(self, worker: Worker) -> None:
        """AllBlocksCleared: every tier of this (worker, DP rank) is empty."""
        state = self._workers.pop(worker, None)
        if state is None:
            return
        bit = self._bits.pop(worker, None)  # none yet if it never held a block
        if bit is None:
            return
        for seq in state.held:
            for masks in self._masks:
                _clear_bit(masks, seq, bit)
        self._free_bits.append(bit)  # clear everywhere now: reuse it

    def _bit(self, worker: Worker) -> int:
        bit = self._bits.get(worker)
        if bit is None:
            bit = self._bits[worker] = self._free_bits.pop() if self._free_bits else 1 << self._next_bit
            self._next_bit += bit == 1 << self._next_bit
        return bit

    # Only a tier's first copy or its last going changes which tier classes hold a block.
    def _tier_added(self, bit: int, seq: int, tier: str) -> None:
        for i in _CLASSES_OF[tier]:
            masks = self._masks[i]
            masks[seq] = masks.get(seq, 0) | bit

    def _tier_dropped(self, bit: int, seq: int, held: _Held, tier: str) -> None:
        get = held.counts.get
        device = get("device", 0) > 0
        host = device or get("host", 0) > 0
        present = (device, host, host or get("disk", 0) > 0)
        for i in _CLASSES_OF[tier]:
            if not present[i]:
                _clear_bit(self._masks[i], seq, bit)

    def remove_worker(self, worker_id: str) -> None:
        for worker in [w for w in self._workers if w[0] == worker_id]:
            self.clear(worker)

    # --- queries ------------------------------------------------------------------------------

    def sequence_hashes(self, tokens: list[int], *, lora_name: str | None = None,
                        cache_salt: str | None = None) -> list[int]:
        local = dynamo_local_block_hashes(tokens, self.block_size, lora_name=lora_name, cache_namespace=cache_salt)
        return dynamo_sequence_hashes(local)

    def overlaps(self, seq_hashes: list[int]) -> dict[Worker, Overlap]:
        """Per worker holding the first block: its device / host / disk continuation depths."""
        if not seq_hashes:
            return {}
        dev, dh, anywhere = (_depths(masks, seq_hashes) for masks in self._masks)
        by_bit = {bit: worker for worker, bit in self._bits.items()}
        return {by_bit[bit]: Overlap(dev.get(bit, 0), dh.get(bit, 0) - dev.get(bit, 0), depth - dh.get(bit, 0))
                for bit, depth in anywhere.items()}

    def external_hashes(self, worker: Worker, seq_hashes: list[int]) -> list[int]:
        """The worker's own published hashes (u64) for the leading blocks it holds."""
        held = self._workers.get(worker, _WorkerState()).held
        out = []
        for seq in seq_hashes:
            h = held.get(seq)
            if h is None:
                break
            out.append(h.external)
        return out

    def workers(self) -> list[Worker]:
        return list(self._workers)

    def num_blocks(self) -> int:
        return sum(len(s.held) for s in self._workers.values())


def _clear_bit(masks: dict[int, int], seq: int, bit: int) -> None:
    mask = masks.get(seq, 0) & ~bit
    if mask:
        masks[seq] = mask
    else:
        masks.pop(seq, None)


def _depths(masks: dict[int, int], seq_hashes: list[int]) -> dict[int, int]:
    """Bit -> how many leading blocks of the request that worker holds (in this tier class)."""
    get = masks.get
    active = get(seq_hashes[0], 0)
    out: dict[int, int] = {}
    for i, seq in enumerate(seq_hashes):
        still = active & get(seq, 0)
        if still != active:
            gone = active & ~still
            while gone:
                low = gone & -gone
                out[low] = i
                gone ^= low
            active = still
            if not active:
                return out
    while active:
        low = active & -active
        out[low] = len(seq_hashes)
        active ^= low
    return out


def _vllm_salt(event: BlockStored) -> str | None:
    """vLLM carries the cache namespace as the first block's extra key "dynamo-cache-salt:<ns>"."""
    extra_keys = dict(event.extra).get("extra_keys")
    first = extra_keys[0] if isinstance(extra_keys, list) and extra_keys else None
    for key in first if isinstance(first, list) else [first]:
        if isinstance(key, str) and key.startswith("dynamo-cache-salt:"):
            return key.split(":", 1)[1]
    return None


def _router_drops(event: BlockStored) -> bool:
    """Events Dynamo's raw consumer drops: other KV groups, non-attention specs, remote locality."""
    extra = dict(event.extra)
    kind = extra.get("kv_cache_spec_kind")
    return (extra.get("group_idx") not in (None, 0) and kind is None) or \
        (kind is not None and kind not in ("full_attention", "mla_attention")) or extra.get("locality") == "REMOTE"
