"""The blocks of the requests a router has sent to each worker and not yet seen finish. Pure: `now` is passed in.

Dynamo counts a worker's decode load once per distinct block of its active requests, so a request
sharing a prefix with one in flight adds little there. The in-flight prefix is also on the
worker's device before its events say so (they follow its backup): until they catch up, for
`linger_s` after the request ends, it counts as held on device. It is never a hint source: only
a runner's published pages are.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .index import Worker


@dataclass
class ActiveBlocks:
    linger_s: float = 5.0
    _active: dict[Worker, Counter] = field(default_factory=dict)   # seq hash -> requests holding it
    _recent: dict[Worker, dict[int, float]] = field(default_factory=dict)  # ended: seq hash -> until
    _next_expiry: float = 0.0

    def start(self, worker: Worker, seq_hashes: list[int]) -> None:
        self._active.setdefault(worker, Counter()).update(seq_hashes)

    def finish(self, worker: Worker, seq_hashes: list[int], now: float, *, computed: bool = True) -> None:
        """The request ended; `computed`: the worker served it (a refused or failed one left no
        prefix on its device to linger)."""
        active, recent = self._active.get(worker), self._recent.setdefault(worker, {})
        if active is None:
            return
        until = now + self.linger_s
        for h in seq_hashes:
            active[h] -= 1
            if active[h] <= 0:
                del active[h]
                if computed:
                    recent[h] = until

    def forget(self, worker: Worker) -> None:
        self._active.pop(worker, None)
        self._recent.pop(worker, None)

    def expire(self, now: float) -> None:
        if now < self._next_expiry:  # asked on every route: a sweep at most every tenth of linger_s
            return
        self._next_expiry = now + self.linger_s / 10
        for worker, recent in self._recent.items():
            gone = [h for h, until in recent.items() if until <= now]
            for h in gone:
                del recent[h]

    def decode_blocks(self, worker: Worker, seq_hashes: list[int]) -> int:
        """Distinct blocks the worker decodes over if this request joins its active ones."""
        active = self._active.get(worker)
        if not active:
            return len(set(seq_hashes))
        return len(active) + len(set(seq_hashes).difference(active))

    def held_depth(self, worker: Worker, seq_hashes: list[int], now: float) -> int:
        """Leading blocks of the request the worker computed for a request still in flight or just
        ended (its device holds them, whatever its events say yet)."""
        active, recent = self._active.get(worker, {}), self._recent.get(worker, {})
        n = 0
        for h in seq_hashes:
            if h not in active and recent.get(h, 0.0) <= now:
                break
            n += 1
        return n
