"""Per-publisher sequence tracking for event consumers: in order, gap, stale or restart.

Pure: the subscriber and the engine relay feed it seq numbers and act on the verdicts.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

RECENT = 16_384  # replayed seqs remembered: only these may legitimately arrive again live


class Verdict(enum.Enum):
    DELIVER = "deliver"      # next in order (or the first one seen)
    GAP = "gap"              # batches [gap_start, seq) are missing: replay them first
    STALE = "stale"          # already delivered (replay overlap): drop
    RESTART = "restart"      # the publisher started over: reset state, then deliver


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What a replay answer covers. The batch that revealed the gap is delivered after `deliver`."""

    lost: tuple[int, int] | None  # [start, stop) that neither live nor replay can supply
    deliver: tuple[int, ...]      # replayed seqs to deliver, in order


@dataclass(slots=True)
class StreamTracker:
    last: int | None = None
    num_gaps: int = 0
    num_missing: int = 0
    num_stale: int = 0
    num_restarts: int = 0
    covered_through: int = -1  # a snapshot covered every batch up to here: older live ones are stale
    _recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _recent_set: set = field(default_factory=set)

    def classify(self, seq: int, starts_with_clear: bool = False) -> tuple[Verdict, int]:
        """Verdict for an arriving live batch, and where a gap starts (else -1). Does not advance."""
        if self.last is None or seq == self.last + 1:
            return Verdict.DELIVER, -1
        if seq > self.last + 1:
            return Verdict.GAP, self.last + 1
        # A PUB socket never repeats a batch: an old seq arriving live is a replay overlap only if
        # we delivered that seq from replay; otherwise the publisher started over (even if its
        # first batches were lost to the slow joiner).
        if seq <= self.covered_through and not starts_with_clear:
            return Verdict.STALE, -1
        if seq == 0 or starts_with_clear or seq not in self._recent_set:
            return Verdict.RESTART, -1
        return Verdict.STALE, -1

    def observe(self, seq: int, starts_with_clear: bool = False) -> tuple[Verdict, int]:
        """classify() plus bookkeeping: counts the verdict and forgets history on a restart."""
        verdict, gap_start = self.classify(seq, starts_with_clear)
        if verdict is Verdict.GAP:
            self.num_gaps += 1
            self.num_missing += seq - gap_start
        elif verdict is Verdict.STALE:
            self.num_stale += 1
        elif verdict is Verdict.RESTART:
            self.num_restarts += 1
            self.last = None
            self.covered_through = -1
            self._recent.clear()
            self._recent_set.clear()
        return verdict, gap_start

    def start_after_snapshot(self, seq: int) -> None:
        self.covered_through = seq
        self.last = seq

    def advance(self, seq: int, *, replayed: bool = False) -> None:
        if replayed:
            if len(self._recent) == self._recent.maxlen:
                self._recent_set.discard(self._recent[0])
            self._recent.append(seq)
            self._recent_set.add(seq)
        self.last = seq

    def plan_replay(self, replayed: list[int], gap_start: int, trigger: int) -> ReplayPlan:
        """Decide what a replay answer covers; skips past what is lost so the stream moves on.

        Replayed batches at or after `trigger` are ignored: they arrive live anyway.
        """
        replayed = sorted(s for s in replayed if s < trigger)
        lost = None
        if not replayed or replayed[0] > gap_start:
            lost = (gap_start, replayed[0] if replayed else trigger)
            self.last = lost[1] - 1
        floor = self.last if self.last is not None else -1
        return ReplayPlan(lost, tuple(s for s in replayed if s > floor))
