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

With `hold_s` > 0 an engine block is held back until the runner holds it too (SGLang backs every
device page up to us in write-through) or `hold_s` has passed: Dynamo's router takes hint
sources from device and host tiers alike, so a block shown before our copy exists would be named
in a hint we cannot serve. A held-back block the engine drops is never shown at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from .keys import to_int64
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
    count: int = 1       # the engine's stores minus its removals
    told: bool = False   # the router was told of it (once, as snapshots and rebuilds tell it)
    since: float = 0.0   # when the engine first stored it


def _never(_event_hash: int) -> bool:
    return False


@dataclass
class EngineMirror:
    block_size: int
    hold_s: float = 0.0  # > 0: show an engine block once the runner holds it, or after this long
    runner_holds: Callable[[int], bool] = _never  # event hash (int64) -> the runner holds that page
    tracker: StreamTracker = field(default_factory=StreamTracker)
    # (medium, hash) -> block, in the order stored: parents come before children.
    blocks: dict[tuple[str | None, int], _Block] = field(default_factory=dict)
    # Blocks held back, oldest first, and how many shown blocks carry each hash (a known parent).
    waiting: dict[tuple[str | None, int], None] = field(default_factory=dict)
    shown: dict[int, int] = field(default_factory=dict)

    def on_batch(self, seq: int, batch: EventBatch, now: float = 0.0) -> RelayStep:
        clears = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
        verdict, gap_start = self.tracker.observe(seq, clears)
        if verdict is Verdict.STALE:
            return RelayStep()
        if verdict is Verdict.GAP:
            return RelayStep(replay_from=gap_start)
        self.tracker.advance(seq)
        if verdict is Verdict.RESTART:
            self._forget()
            return self._apply(batch, True, now, "engine restarted")
        return self._apply(batch, False, now)

    def after_replay(self, replayed: Sequence[tuple[int, EventBatch]], gap_start: int, seq: int,
                     batch: EventBatch, now: float = 0.0) -> list[RelayStep]:
        """Steps for a gap: the replayed batches, then the batch that revealed it."""
        plan = self.tracker.plan_replay([s for s, _ in replayed], gap_start, seq)
        steps = []
        if plan.lost is not None:
            self._forget()
            steps.append(RelayStep(resync=True, problem=f"engine batches [{plan.lost[0]}, {plan.lost[1]}) "
                                                        "could not be replayed"))
        wanted = set(plan.deliver)
        for replayed_seq, replayed_batch in replayed:
            if replayed_seq in wanted:
                self.tracker.advance(replayed_seq, replayed=True)
                steps.append(self._apply(replayed_batch, False, now))
        self.tracker.advance(seq)
        steps.append(self._apply(batch, False, now))
        return steps

    def rebuild(self, batches: Sequence[tuple[int, EventBatch]], now: float = 0.0) -> bool:
        """Rebuild from a replay from seq 0 (runner restart). True if the mirror is complete."""
        self._forget()
        # An engine's buffer is empty only before its first batch; otherwise it must still hold seq 0.
        complete = not batches or batches[0][0] == 0
        for seq, batch in batches:
            self.tracker.advance(seq, replayed=True)
            self._apply(batch, False, now)
        if not complete:
            self._forget()
        return complete

    def runner_stored(self, event_hashes: Sequence[int], now: float) -> tuple[Event, ...]:
        """The runner stored pages with these event hashes: engine blocks waiting for them are shown."""
        if not self.waiting:
            return ()
        stored = {to_int64(h) for h in event_hashes}
        if not any(key[1] in stored for key in self.waiting):
            return ()
        return self._release(now)

    def expire(self, now: float) -> tuple[Event, ...]:
        """Engine blocks held back for `hold_s` are shown anyway (the runner may never get them)."""
        if not self.waiting or self.blocks[next(iter(self.waiting))].since + self.hold_s > now:
            return ()
        return self._release(now)

    def _forget(self) -> None:
        self.blocks.clear()
        self.waiting.clear()
        self.shown.clear()

    def _ready(self, key: tuple[str | None, int], block: _Block, now: float) -> bool:
        """Shown once the runner holds it (after a known parent), or anyway after `hold_s`."""
        if now - block.since >= self.hold_s:
            return True
        parent_known = block.parent is None or block.parent in self.shown or self.runner_holds(block.parent)
        return parent_known and self.runner_holds(key[1])

    def _show(self, key: tuple[str | None, int], block: _Block) -> None:
        block.told = True
        self.shown[key[1]] = self.shown.get(key[1], 0) + 1

    def _release(self, now: float) -> tuple[Event, ...]:
        out = []
        for key in list(self.waiting):  # oldest first: a parent is shown before its children are looked at
            block = self.blocks[key]
            if self._ready(key, block, now):
                del self.waiting[key]
                self._show(key, block)
                out.append(block.event)
        return tuple(out)

    def _apply(self, batch: EventBatch, resync: bool, now: float, problem: str = "") -> RelayStep:
        events = batch.events
        clears = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
        if clears:
            # Whatever came before the last clear is wiped by it; the resync re-sends the clear.
            events = events[clears[-1] + 1:]
            self._forget()
            resync = True
        out: list[Event] = []
        for event in events:
            if isinstance(event, BlockStored):
                if event.block_size != self.block_size:
                    problem = (f"engine block_size {event.block_size} != runner.block_size {self.block_size}: "
                               "event not relayed")
                    continue
                out.extend(self._store(event, now))
            elif isinstance(event, BlockRemoved):
                out.extend(self._remove(event))
        if batch.rejected:
            problem = problem or f"{len(batch.rejected)} malformed engine events dropped: {batch.rejected[0]}"
        return RelayStep(tuple(out), resync, problem=problem)

    def _store(self, event: BlockStored, now: float) -> list[Event]:
        """What to forward of an engine store: the event as it is when every block shows now,
        else the blocks that do, one by one."""
        parent, shows = event.parent_block_hash, []
        for i, h in enumerate(event.block_hashes):
            key = (event.medium, to_int64(h))
            block = self.blocks.get(key)
            if block is None:
                tokens = event.token_ids[i * self.block_size:(i + 1) * self.block_size]
                single = BlockStored(block_hashes=(h,), parent_block_hash=parent, token_ids=tokens,
                                     block_size=self.block_size, medium=event.medium, lora_name=event.lora_name,
                                     cache_salt=event.cache_salt, extra=event.extra)
                block = self.blocks[key] = _Block(None if parent is None else to_int64(parent), single, 0, since=now)
                self.waiting[key] = None
            block.count += 1
            if key in self.waiting and self._ready(key, block, now):
                del self.waiting[key]
                self._show(key, block)
                shows.append(block.event)
            parent = h
        if len(shows) == len(event.block_hashes):
            return [event]
        return shows

    def _remove(self, event: BlockRemoved) -> list[Event]:
        """The removal of blocks the router was told of, once the engine holds none of them. A
        block we never mirrored is not the router's either (it was cleared with us): forwarding
        its removal would take a runner copy Dynamo counts in the same tier."""
        forward = []
        for h in event.block_hashes:
            key = (event.medium, to_int64(h))
            block = self.blocks.get(key)
            if block is None:
                continue
            block.count -= 1
            if block.count > 0:
                continue
            del self.blocks[key]
            self.waiting.pop(key, None)
            if block.told:
                forward.append(h)
                self.shown[key[1]] -= 1
                if not self.shown[key[1]]:
                    del self.shown[key[1]]
        if len(forward) == len(event.block_hashes):
            return [event]
        return [BlockRemoved(block_hashes=tuple(forward), medium=event.medium, extra=event.extra)] if forward else []

    def inventory(self) -> list[BlockStored]:
        """The engine's blocks the router was shown, as BlockStored events, parents first."""
        return [b.event for b in self.blocks.values() if b.told]
