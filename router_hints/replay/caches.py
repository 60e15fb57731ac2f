"""A simulated worker's block caches (DRAM, NVMe) and the events they publish. Pure.

Each tier is an LRU over block ids, touched on use and filled after the request, a request's
head most recent (as kvcr's pool touches a chain). NVMe is written behind: a block stored in DRAM
is stored on NVMe too, so each tier evicts on its own. Every change is published as the vLLM
events a kvcr runner sends (`CPU_TIER1` for its DRAM, `DISK`), for the router's real index to consume.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from itertools import islice, takewhile
from operator import add, and_
from typing import Sequence

from kvcr.proto.events import BlockRemoved, BlockStored, Event

SIM_BLOCK = 1  # tokens per block in the router's eyes: a trace block is one token, its id
# The token standing for a trace block: its id as a u32 (the id already implies its prefix, and
# ids below 2**32 never collide); C-speed in map().
block_token = partial(and_, 0xFFFF_FFFF)


external = partial(add, 1)  # the hash a simulated engine publishes for a block id (never 0); C-speed in map()


class BlockLRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def __len__(self) -> int:
        return len(self._order)

    def leading(self, blocks: Sequence[int], start: int = 0) -> int:
        """How many of blocks[start:] are held, in a row."""
        return len(list(takewhile(self._order.__contains__, islice(blocks, start, None))))  # C speed

    def touch(self, blocks: Sequence[int]) -> None:
        order = self._order
        any(map(order.move_to_end, filter(order.__contains__, reversed(blocks))))  # C speed (each gives None)

    def fill(self, blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Hold `blocks` (a request's chain, root first), head most recent; returns (stored,
        evicted). With no capacity nothing is held."""
        if self.capacity <= 0:
            return [], []
        order = self._order
        head = self.leading(blocks)
        stored = []
        for block in reversed(blocks[head:]):  # tail first: the head ends most recent
            if block in order:
                order.move_to_end(block)
            else:
                order[block] = None
                stored.append(block)
        any(map(order.move_to_end, reversed(blocks[:head])))  # held, as leading() found; at C speed (each gives None)
        stored.reverse()
        evicted = [order.popitem(last=False)[0] for _ in range(len(order) - self.capacity)]
        if evicted:
            gone = set(evicted)
            stored = [b for b in stored if b not in gone]
        return stored, evicted


def stored_events(blocks: Sequence[int], stored: list[int], medium: str) -> list[Event]:
    """One BlockStored per run of newly stored blocks, each naming its parent (the block before it
    in the request)."""
    if not stored:
        return []
    tail = len(blocks) - len(stored)
    if list(blocks[tail:]) == stored:  # the usual case: a held head, then one new run to the end
        return [_stored(stored, blocks[tail - 1] if tail else None, medium)]
    new = set(stored)
    events: list[Event] = []
    run: list[int] = []
    parent = None
    for i, block in enumerate(blocks):
        if block in new:
            if not run:
                parent = blocks[i - 1] if i else None
            run.append(block)
        elif run:
            events.append(_stored(run, parent, medium))
            run = []
    if run:
        events.append(_stored(run, parent, medium))
    return events


def _stored(run: list[int], parent: int | None, medium: str) -> BlockStored:
    return BlockStored(block_hashes=tuple(map(external, run)),
                       parent_block_hash=external(parent) if parent is not None else None,
                       token_ids=tuple(map(block_token, run)), block_size=SIM_BLOCK,
                       medium=medium)


class WorkerCache:
    """DRAM and NVMe tiers of one simulated worker."""

    def __init__(self, dram_blocks: int, nvme_blocks: int) -> None:
        self.dram = BlockLRU(dram_blocks)
        self.nvme = BlockLRU(nvme_blocks)

    def reusable(self, blocks: Sequence[int]) -> tuple[int, int]:
        """(leading blocks in DRAM, then blocks continuing that run on NVMe)."""
        dram = self.dram.leading(blocks)
        n = dram
        while n < len(blocks) and (blocks[n] in self.dram or blocks[n] in self.nvme):
            n += 1
        return dram, n - dram

    def holds(self, block: int) -> bool:
        return block in self.dram or block in self.nvme

    def fill(self, blocks: Sequence[int], publish: bool = True) -> list[Event]:
        """The request was served here: its blocks are held (touched or stored) in both tiers;
        returns the events that says (none unless `publish`)."""
        events: list[Event] = []
        for tier, medium in ((self.dram, "CPU_TIER1"), (self.nvme, "DISK")):
            stored, evicted = tier.fill(blocks)
            if not publish:
                continue
            events += stored_events(blocks, stored, medium)
            if evicted:
                events.append(BlockRemoved(block_hashes=tuple(map(external, evicted)), medium=medium))
        return events
