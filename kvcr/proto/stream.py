"""Per-publisher sequence tracking for event consumers: in order, gap, stale or restart.

Pure: the subscriber feeds it seq numbers and acts on the verdicts (replay, snapshot, reset).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    DELIVER = "deliver"      # next in order (or the first one seen)
    GAP = "gap"              # batches [gap_start, seq) are missing: replay them first
    STALE = "stale"          # already seen: drop
    RESTART = "restart"      # the publisher started over: reset state, then deliver


@dataclass(slots=True)
class StreamTracker:
    last: int | None = None
    num_gaps: int = 0
    num_missing: int = 0
    num_stale: int = 0
    num_restarts: int = 0

    def classify(self, seq: int, starts_with_clear: bool = False) -> tuple[Verdict, int]:
        """Verdict for an arriving batch, and where a gap starts (else -1). Does not advance."""
        if self.last is None or seq == self.last + 1:
            return Verdict.DELIVER, -1
        if seq > self.last + 1:
            return Verdict.GAP, self.last + 1
        # A publisher that counts from 0 again (vLLM/SGLang engines) or that re-sends a clear.
        if seq == 0 or starts_with_clear:
            return Verdict.RESTART, -1
        return Verdict.STALE, -1

    def advance(self, seq: int) -> None:
        self.last = seq

    def note(self, verdict: Verdict, seq: int, gap_start: int) -> None:
        if verdict is Verdict.GAP:
            self.num_gaps += 1
            self.num_missing += seq - gap_start
        elif verdict is Verdict.STALE:
            self.num_stale += 1
        elif verdict is Verdict.RESTART:
            self.num_restarts += 1
