"""Which peer sources are worth asking: a source that did not answer is skipped for a while.

Pure (`now` passed in). A lookup that waits on an unreachable source blocks the engine's prefetch
thread, and every request behind it, for the whole control timeout; without a memory, each hint
naming that source would block again. The back-off doubles per failure up to a ceiling and ends
with the first answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_BACKOFF_FACTOR = 16  # the ceiling: 16 x the first back-off


@dataclass
class _Down:
    failures: int
    until: float


@dataclass
class Reachability:
    backoff_s: float = 5.0
    num_failures: int = 0   # attempts that got no answer
    num_skipped: int = 0    # attempts not made: the source was still backing off
    _down: dict[str, _Down] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.backoff_s > 0, f"backoff_s {self.backoff_s} must be > 0"

    def allow(self, endpoint: str, now: float) -> bool:
        """Whether to try `endpoint` now; a refusal is counted."""
        down = self._down.get(endpoint)
        if down is None or now >= down.until:
            return True
        self.num_skipped += 1
        return False

    def failed(self, endpoint: str, now: float) -> float:
        """`endpoint` did not answer; returns when it may be tried again."""
        self.num_failures += 1
        failures = self._down[endpoint].failures + 1 if endpoint in self._down else 1
        wait = self.backoff_s * min(2 ** (failures - 1), MAX_BACKOFF_FACTOR)
        self._down[endpoint] = _Down(failures, now + wait)
        return now + wait

    def answered(self, endpoint: str) -> None:
        self._down.pop(endpoint, None)

    def is_down(self, endpoint: str, now: float) -> bool:
        down = self._down.get(endpoint)
        return down is not None and now < down.until
