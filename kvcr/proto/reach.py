"""Which peer sources are worth asking: a source that did not answer is skipped for a while.

Pure (`now` passed in). A lookup that waits on an unreachable source blocks the engine's prefetch
thread, and every request behind it, for the whole control timeout; without a memory, each hint
naming that source would block again. The back-off doubles per failure up to a ceiling and ends
with the first answer.

A source that comes back must not wait out its back-off unseen: while it is down it is probed off
the request path (an info request every `probe_s`, by the puller's prober thread), and the first
answer ends the back-off. The probes are scheduled here; the prober only sends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_BACKOFF_FACTOR = 16  # the ceiling: 16 x the first back-off


@dataclass
class _Down:
    failures: int
    until: float
    next_probe: float


@dataclass
class Reachability:
    backoff_s: float = 5.0
    probe_s: float = 0.25  # a down source is probed this often; 0: never (it waits out its back-off)
    num_failures: int = 0   # attempts that got no answer
    num_skipped: int = 0    # attempts not made: the source was still backing off
    num_recovered: int = 0  # back-offs a probe's answer ended early
    _down: dict[str, _Down] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.backoff_s > 0, f"backoff_s {self.backoff_s} must be > 0"
        assert self.probe_s >= 0, f"probe_s {self.probe_s} must be >= 0"

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
        self._down[endpoint] = _Down(failures, now + wait, now + self.probe_s)
        return now + wait

    def answered(self, endpoint: str) -> None:
        self._down.pop(endpoint, None)

    def probe_answered(self, endpoint: str) -> bool:
        """A probe got an answer: the back-off is over. True when one was running."""
        if self._down.pop(endpoint, None) is None:
            return False
        self.num_recovered += 1
        return True

    def probes_due(self, now: float) -> list[str]:
        """Down sources to probe now; each is next due `probe_s` later (a probe that gets no
        answer changes nothing else: the back-off keeps its own clock). Only while a back-off
        runs: after it the next request asks the source itself, so a peer nobody asks for any
        more is not probed for ever."""
        if not self.probe_s:
            return []
        due = [ep for ep, down in self._down.items() if down.next_probe <= now < down.until]
        for ep in due:
            self._down[ep].next_probe = now + self.probe_s
        return due

    def next_probe_at(self, now: float) -> float | None:
        """When the next probe falls due (None: no back-off runs, or probes are off)."""
        times = [down.next_probe for down in self._down.values() if now < down.until and down.next_probe < down.until]
        return min(times) if self.probe_s and times else None

    def is_down(self, endpoint: str, now: float) -> bool:
        down = self._down.get(endpoint)
        return down is not None and now < down.until
