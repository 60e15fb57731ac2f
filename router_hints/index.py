"""Inventory index: which worker (and DP rank) holds which block in which tier. Pure.

Fed decoded event batches (any publisher: engines, our runners); answers, per worker, how deep a
request's prefix is held on device, then continued through the engine's host pool, then a
runner's DRAM, then disk (Dynamo's semantics, with a runner's DRAM apart from the engine's host
pool), and separately how much of it the worker's runner holds (what a peer can pull). Blocks are
matched by content: like Dynamo's router we recompute a hash from each stored block's tokens
(XXH3, salted by LoRA name and cache namespace) and chain it with its parent's, so engines with
different event hash schemes still match the same prompt. The engine's own hash is kept per
worker as an identity for parent links, removals and hints.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate, repeat, takewhile
from operator import and_, is_not, itemgetter, neg

from kvcr.proto.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcr.proto.keys import U64_MASK
from kvcr.proto.tokenhash import dynamo_block_sequence_hashes

# Tiers: the engine's GPU pool; the engine's host pool (SGLang's L2, not servable to peers); a
# runner's DRAM; a runner's NVMe; a shared pool outside this worker (scored as disk, not its runner's).
_DEVICE, _HOST, _DRAM, _DISK, _SHARED = range(5)
_NUM_TIERS = _SHARED + 1
_MEDIUM_TIER = {None: _DEVICE, "GPU": _DEVICE, "DEVICE": _DEVICE,
                "CPU": _HOST, "CPU_PINNED": _HOST,
                "CPU_TIER1": _DRAM,
                "CPU_TIER2": _DISK, "DISK": _DISK, "NVME": _DISK, "STORAGE": _DISK,
                "EXTERNAL": _SHARED, "SHARED": _SHARED, "REMOTE": _SHARED, "NETWORK": _SHARED}

Worker = tuple[str, int]  # (worker id, DP rank)
# Matching reads tier classes, each a set of tiers (bit t: tier t): a worker owns one adjacent bit
# ("lane") of each block's mask per class, set while any tier of the class holds the block.
_CLASS_TIERS = (1 << _DEVICE,                                      # device
                1 << _DEVICE | 1 << _HOST,                         # device or host
                1 << _DEVICE | 1 << _HOST | 1 << _DRAM,            # device, host or DRAM
                (1 << _NUM_TIERS) - 1,                             # anywhere
                1 << _DRAM | 1 << _DISK)                           # the worker's runner
_NUM_LANES = len(_CLASS_TIERS)
_ALL_LANES = (1 << _NUM_LANES) - 1
_DEVICE_LANE, _HOST_LANE, _DRAM_LANE, _ANYWHERE_LANE, _RUNNER_LANE = range(_NUM_LANES)  # shifts of a lane base
_TIER_LANES = tuple(sum(1 << c for c, tiers in enumerate(_CLASS_TIERS) if tiers >> t & 1) for t in range(_NUM_TIERS))
_EXTERNAL = 0  # a held entry: [the publisher's own hash (u64), one refcount per tier]
_is_held = partial(is_not, None)


def _drop_lanes(tier: int, present: int) -> int:
    """The lanes a block leaves when its last copy in `tier` goes, given which tiers still hold
    it (bit t set: tier t does): each class of that tier that no remaining tier fills."""
    return sum(1 << c for c, tiers in enumerate(_CLASS_TIERS) if tiers >> tier & 1 and not tiers & present)


# a held entry's refcounts after its first copy, by tier
_FIRST_COPY = tuple(tuple(int(t == tier) for t in range(_NUM_TIERS)) for tier in range(_NUM_TIERS))
_DROP_LANES = tuple(tuple(_drop_lanes(tier, present) for present in range(1 << _NUM_TIERS))
                    for tier in range(_NUM_TIERS))


@dataclass(frozen=True, slots=True)
class Overlap:
    """Leading blocks of a request a worker holds: on device, then continued through the engine's
    host pool, a runner's DRAM, then disk; `runner`: the leading blocks its runner holds (DRAM or
    the runner's disk), apart from the continuation."""

    device: int = 0
    host: int = 0
    dram: int = 0
    disk: int = 0
    runner: int = 0

    @property
    def depth(self) -> int:
        return self.device + self.host + self.dram + self.disk


NO_OVERLAP = Overlap()  # a worker holding none of a request


@dataclass
class _WorkerState:
    # engine hash (u64) -> our content sequence hash
    by_external: dict[int, int] = field(default_factory=dict)
    # sequence hash -> [external, device, host, dram, disk, shared]: a flat list, as ingest makes one per block
    held: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class InventoryIndex:
    block_size: int
    num_events: int = 0
    num_ignored: int = 0          # events a router must drop (unknown medium, wrong block size ...)
    num_unknown_parent: int = 0
    _workers: dict[Worker, _WorkerState] = field(default_factory=dict)
    # Matching is one integer AND per block: every worker gets a lane base (1 << 5k), and each
    # block a mask of which workers hold it in each tier class (their lanes).
    _bits: dict[Worker, int] = field(default_factory=dict)
    _free_bits: list[int] = field(default_factory=list)
    _next_bit: int = 0
    _masks: dict[int, int] = field(default_factory=dict)

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
        if tier is None or event.block_size != self.block_size or (event.extra and _router_drops(event)):
            self.num_ignored += 1
            return
        parent_seq = None
        if event.parent_block_hash is not None:
            parent_seq = state.by_external.get(event.parent_block_hash & U64_MASK)
            if parent_seq is None:
                self.num_unknown_parent += 1
                return
        tokens, n = event.token_ids, self.block_size * len(event.block_hashes)
        namespace = event.cache_salt or (_vllm_salt(event) if event.extra else None)
        seqs = dynamo_block_sequence_hashes(tokens if len(tokens) == n else tokens[:n], self.block_size,
                                            lora_name=event.lora_name, cache_namespace=namespace, parent=parent_seq)
        externals = _u64(event.block_hashes)
        state.by_external.update(zip(externals, seqs))
        _count_stored(state.held, self._masks, externals, seqs, tier + 1, self._bit(worker) * _TIER_LANES[tier])

    def _removed(self, worker: Worker, state: _WorkerState, event: BlockRemoved) -> None:
        tier = _MEDIUM_TIER.get(event.medium)
        if tier is None:
            self.num_ignored += 1
            return
        _count_removed(state.by_external, state.held, self._masks, _u64(event.block_hashes), tier + 1,
                       self._bits.get(worker, 0), _DROP_LANES[tier])

    def clear(self, worker: Worker) -> None:
        """AllBlocksCleared: every tier of this (worker, DP rank) is empty."""
        state = self._workers.pop(worker, None)
        if state is None:
            return
        bit = self._bits.pop(worker, None)  # none yet if it never held a block
        if bit is None:
            return
        for seq in state.held:
            _clear_bit(self._masks, seq, bit * _ALL_LANES)
        self._free_bits.append(bit)  # clear everywhere now: reuse it

    def _bit(self, worker: Worker) -> int:
        bit = self._bits.get(worker)
        if bit is None:
            bit = self._bits[worker] = self._free_bits.pop() if self._free_bits else 1 << (_NUM_LANES * self._next_bit)
            self._next_bit += bit == 1 << (_NUM_LANES * self._next_bit)
        return bit

    def remove_worker(self, worker_id: str) -> None:
        for worker in [w for w in self._workers if w[0] == worker_id]:
            self.clear(worker)

    # --- queries ------------------------------------------------------------------------------

    def sequence_hashes(self, tokens: list[int], *, lora_name: str | None = None,
                        cache_salt: str | None = None) -> list[int]:
        return dynamo_block_sequence_hashes(tokens, self.block_size, lora_name=lora_name, cache_namespace=cache_salt)

    def overlaps(self, seq_hashes: list[int]) -> dict[Worker, Overlap]:
        """Per worker holding the first block: its device / host / DRAM / disk continuation depths
        and its runner's depth."""
        if not seq_hashes:
            return {}
        get = _depths(self._masks, seq_hashes).get
        out = {}
        for worker, bit in self._bits.items():
            anywhere = get(bit << _ANYWHERE_LANE)
            if anywhere:
                device, host, dram = get(bit << _DEVICE_LANE, 0), get(bit << _HOST_LANE, 0), get(bit << _DRAM_LANE, 0)
                out[worker] = Overlap(device, host - device, dram - host, anywhere - dram, get(bit << _RUNNER_LANE, 0))
        return out

    def external_hashes(self, worker: Worker, seq_hashes: list[int]) -> list[int]:
        """The worker's own published hashes (u64) for the leading blocks it holds in any tier
        (a hint passes only its runner's run: `Overlap.runner`)."""
        held = self._workers.get(worker, _WorkerState()).held
        return list(map(itemgetter(_EXTERNAL), takewhile(_is_held, map(held.get, seq_hashes))))  # C speed

    def workers(self) -> list[Worker]:
        return list(self._workers)

    def num_blocks(self) -> int:
        return sum(len(s.held) for s in self._workers.values())


def _u64(hashes: tuple[int, ...]) -> tuple[int, ...] | list[int]:
    """Published hashes as the index keys them (u64); signed ones, as some engines send, wrap."""
    return hashes if min(hashes) >= 0 else [h & U64_MASK for h in hashes]


def _count_stored_py(holding: dict[int, list[int]], masks: dict[int, int], externals, seqs, slot: int,
                     lanes: int) -> None:
    """Count a stored run's blocks in the tier at `slot` (1.._NUM_TIERS of a held entry); a tier's
    first copy of a block sets the worker's lanes of its classes."""
    for external, seq in zip(externals, seqs):
        held = holding.get(seq)
        if held is None:
            holding[seq] = [external, *_FIRST_COPY[slot - 1]]
        elif held[slot]:
            held[slot] += 1
            continue
        else:
            held[slot] = 1
        masks[seq] = masks.get(seq, 0) | lanes


def _count_removed_py(by_external: dict[int, int], holding: dict[int, list[int]], masks: dict[int, int], externals,
                      slot: int, bit: int, drops: tuple[int, ...]) -> None:
    """Uncount removed blocks in the tier at `slot`; a tier's last copy clears the classes no
    other tier still fills, and a block no tier holds is forgotten."""
    for external in externals:
        seq = by_external.get(external)
        held = holding.get(seq)
        if held is None or not held[slot]:
            continue
        held[slot] -= 1
        if held[slot]:
            continue
        present = 0
        for tier, count in enumerate(held[1:]):
            present |= (count > 0) << tier
        _clear_bit(masks, seq, bit * drops[present])
        if not present:
            del holding[seq]
            del by_external[external]


# The same loops in C (router_hints/_inventory.c), built at install when a compiler is there.
try:
    from router_hints._inventory import NUM_TIERS as _NATIVE_TIERS, removed as _count_removed, stored as _count_stored
except ImportError:  # not built, or built before NUM_TIERS existed
    _NATIVE_TIERS = 0
if _NATIVE_TIERS != _NUM_TIERS:  # a stale build counts another tier layout: use the reference loops
    _count_stored, _count_removed = _count_stored_py, _count_removed_py


def _clear_bit(masks: dict[int, int], seq: int, bits: int) -> None:
    mask = masks.get(seq, 0) & ~bits
    if mask:
        masks[seq] = mask
    else:
        masks.pop(seq, None)


def _depths(masks: dict[int, int], seq_hashes: list[int]) -> dict[int, int]:
    """Lane bit -> how many leading blocks of the request that worker holds in that tier class.

    The running AND of the blocks' masks only loses bits, so it never grows as a number: it is
    built at C speed (map, accumulate) and each holder's depth is found by bisection, not a walk."""
    held = list(accumulate(map(masks.get, seq_hashes, repeat(0, len(seq_hashes))), and_))
    out: dict[int, int] = {}
    start, value = 0, held[0]
    while value:
        end = bisect_right(held, -value, lo=start, key=neg)  # the first block this set stops holding
        left = held[end] if end < len(held) else 0
        gone = value & ~left
        while gone:
            low = gone & -gone
            out[low] = end
            gone ^= low
        start, value = end, left
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
