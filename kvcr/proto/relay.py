"""Relaying the engine's own event stream into the runner's, so a router sees one stream.

Dynamo keeps one index per (worker, DP rank) and `AllBlocksCleared` wipes all of its tiers, so the
engine's GPU/host events and the runner's DRAM/NVMe events must share one stream and one seq.
`EngineMirror` tracks what the engine has announced and decides what to forward. Rules:

- in-order engine batches are forwarded as they are (block_size checked against ours);
- an engine `AllBlocksCleared` also wipes the runner's tiers at the router: it is forwarded as
  a resync (the clear, then our inventory), followed by the batch's later events;
- an engine restart (its seq goes back) means its blocks are gone: clear, re-announce ours;
- a gap is replayed from the engine's replay socket; if replay cannot fill it the mirror is no
  longer trustworthy, so we clear and re-announce only our own tiers (forgetting engine blocks
  until the engine announces them again, rather than keeping blocks that may be gone);
- a restarted runner rebuilds the mirror by replaying the engine's stream from seq 0, and
  re-announces it only if the engine's buffer still starts at 0 (nothing was missed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from .stream import StreamTracker, Verdict


@dataclass(frozen=True, slots=True)
class RelayStep:
    """What to do with one engine batch: publish `events`, after an optional resync.

    A resync is `AllBlocksCleared` followed by the runner's own inventory."""

    events: tuple[Event, ...] = ()
    resync: bool = False
    replay_from: int = -1  # >= 0: ask the engine's replay socket from this seq first
    problem: str = ""      # non-empty: something worth counting and logging


@dataclass
class _Block:
    parent: int | None
    tokens: tuple[int, ...]
    lora_name: str | None
    cache_salt: str | None
    count: int = 1


@dataclass
class EngineMirror:
    block_size: int
    tracker: StreamTracker = field(default_factory=StreamTracker)
    # (medium, hash) -> block, in the order stored: parents come before children.
    blocks: dict[tuple[str | None, int], _Block] = field(default_factory=dict)
    num_wrong_block_size: int = 0

    def on_batch(self, seq: int, batch: EventBatch) -> RelayStep:
        clears = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
        verdict, gap_start = self.tracker.classify(seq, clears)
        self.tracker.note(verdict, seq, gap_start)
        if verdict is Verdict.STALE:
            return RelayStep()
        if verdict is Verdict.GAP:
            return RelayStep(replay_from=gap_start)
        self.tracker.advance(seq)
        if verdict is Verdict.RESTART:
            self.blocks.clear()
            return self._apply(batch, True, "engine restarted")
        return self._apply(batch, False)

    def on_replayed(self, batches: Sequence[tuple[int, EventBatch]], gap_start: int) -> list[RelayStep]:
        """Steps for the batches replay returned; a replay that misses the gap start resyncs."""
        steps = []
        if not batches or batches[0][0] > gap_start:
            self.blocks.clear()
            steps.append(RelayStep(resync=True, problem="engine replay could not fill the gap"))
            if batches:
                self.tracker.advance(batches[0][0] - 1)
        for seq, batch in batches:
            if self.tracker.last is not None and seq <= self.tracker.last:
                continue
            self.tracker.advance(seq)
            steps.append(self._apply(batch, False))
        return steps

    def rebuild(self, batches: Sequence[tuple[int, EventBatch]]) -> bool:
        """Rebuild from a replay from seq 0 (runner restart). True if the mirror is complete."""
        self.blocks.clear()
        # An engine's buffer is empty only before its first batch; otherwise it must still hold seq 0.
        complete = not batches or batches[0][0] == 0
        for seq, batch in batches:
            self.tracker.advance(seq)
            self._apply(batch, False)
        if not complete:
            self.blocks.clear()
        return complete

    def _apply(self, batch: EventBatch, resync: bool, problem: str = "") -> RelayStep:
        events = batch.events
        clears = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
        if clears:
            # Whatever came before the last clear is wiped by it; the resync re-sends the clear.
            events = events[clears[-1] + 1:]
            self.blocks.clear()
            resync = True
        out: list[Event] = []
        for event in events:
            if isinstance(event, BlockStored):
                if event.block_size != self.block_size:
                    self.num_wrong_block_size += 1
                    problem = (f"engine block_size {event.block_size} != runner.block_size {self.block_size}: "
                               "event not relayed")
                    continue
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            out.append(event)
        return RelayStep(tuple(out), resync, problem=problem)

    def _store(self, event: BlockStored) -> None:
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            key = (event.medium, h)
            block = self.blocks.get(key)
            if block is not None:
                block.count += 1
            else:
                tokens = event.token_ids[i * self.block_size:(i + 1) * self.block_size]
                self.blocks[key] = _Block(parent, tuple(tokens), event.lora_name, event.cache_salt)
            parent = h

    def _remove(self, event: BlockRemoved) -> None:
        for h in event.block_hashes:
            key = (event.medium, h)
            block = self.blocks.get(key)
            if block is None:
                continue
            block.count -= 1
            if block.count <= 0:
                del self.blocks[key]

    def inventory(self) -> list[BlockStored]:
        """The engine's blocks as BlockStored events, parents first."""
        return [BlockStored(block_hashes=(h,), parent_block_hash=b.parent, token_ids=b.tokens,
                            block_size=self.block_size, medium=medium, lora_name=b.lora_name,
                            cache_salt=b.cache_salt) for (medium, h), b in self.blocks.items()]
