"""Relaying the engine's own event stream into the runner's, so a router sees one stream.

Dynamo keeps one index per (worker, DP rank) and `AllBlocksCleared` wipes all of its tiers, so the
engine's GPU/host events and the runner's DRAM/NVMe events must share one stream and one seq.
`EngineMirror` tracks what the engine has announced and decides what to forward. Rules:

- in-order engine batches are forwarded as they are (block_size checked against ours);
- an engine `AllBlocksCleared` also wipes the runner's tiers at the router: it is forwarded as
  a resync (the clear, then our inventory), followed by the batch's later events;
- an engine restart (its seq goes back) means its blocks are gone: resync;
- a gap is replayed from the engine's replay socket; if replay cannot fill it the mirror is no
  longer trustworthy, so we resync with only our own tiers (forgetting engine blocks until the
  engine announces them again, rather than keeping blocks that may be gone);
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
    replay_from: int = -1  # >= 0: ask the engine's replay socket from this seq, then call after_replay
    problem: str = ""      # non-empty: something worth counting and logging


@dataclass
class _Block:
    parent: int | None
    event: BlockStored  # the single-block event to re-announce (keeps the engine's extra fields)
    count: int = 1


@dataclass
class EngineMirror:
    block_size: int
    tracker: StreamTracker = field(default_factory=StreamTracker)
    # (medium, hash) -> block, in the order stored: parents come before children.
    blocks: dict[tuple[str | None, int], _Block] = field(default_factory=dict)

    def on_batch(self, seq: int, batch: EventBatch) -> RelayStep:
        clears = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
        verdict, gap_start = self.tracker.observe(seq, clears)
        if verdict is Verdict.STALE:
            return RelayStep()
        if verdict is Verdict.GAP:
            return RelayStep(replay_from=gap_start)
        self.tracker.advance(seq)
        if verdict is Verdict.RESTART:
            self.blocks.clear()
            return self._apply(batch, True, "engine restarted")
        return self._apply(batch, False)

    def after_replay(self, replayed: Sequence[tuple[int, EventBatch]], gap_start: int, seq: int,
                     batch: EventBatch) -> list[RelayStep]:
        """Steps for a gap: the replayed batches, then the batch that revealed it."""
        plan = self.tracker.plan_replay([s for s, _ in replayed], gap_start, seq)
        steps = []
        if plan.lost is not None:
            self.blocks.clear()
            steps.append(RelayStep(resync=True, problem=f"engine batches [{plan.lost[0]}, {plan.lost[1]}) "
                                                        "could not be replayed"))
        wanted = set(plan.deliver)
        for replayed_seq, replayed_batch in replayed:
            if replayed_seq in wanted:
                self.tracker.advance(replayed_seq, replayed=True)
                steps.append(self._apply(replayed_batch, False))
        self.tracker.advance(seq)
        steps.append(self._apply(batch, False))
        return steps

    def rebuild(self, batches: Sequence[tuple[int, EventBatch]]) -> bool:
        """Rebuild from a replay from seq 0 (runner restart). True if the mirror is complete."""
        self.blocks.clear()
        # An engine's buffer is empty only before its first batch; otherwise it must still hold seq 0.
        complete = not batches or batches[0][0] == 0
        for seq, batch in batches:
            self.tracker.advance(seq, replayed=True)
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
                    problem = (f"engine block_size {event.block_size} != runner.block_size {self.block_size}: "
                               "event not relayed")
                    continue
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            out.append(event)
        if batch.rejected:
            problem = problem or f"{len(batch.rejected)} malformed engine events dropped: {batch.rejected[0]}"
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
                single = BlockStored(block_hashes=(h,), parent_block_hash=parent, token_ids=tokens,
                                     block_size=self.block_size, medium=event.medium, lora_name=event.lora_name,
                                     cache_salt=event.cache_salt, extra=event.extra)
                self.blocks[key] = _Block(parent, single)
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
        return [b.event for b in self.blocks.values()]
