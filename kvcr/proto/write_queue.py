"""WriteQueue: a pool's READY pages the tier below does not hold yet (DIRTY), in commit order, and
the ones its writer is reading now. Pure: no memory, no I/O, commit times passed in."""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice

from .page import Page


class WriteQueue:
    def __init__(self) -> None:
        self._queued: OrderedDict[str, float] = OrderedDict()  # key -> commit time, oldest first
        # Pages the writer is reading, by slot -> (page, commit time). They keep their LRU place
        # (a write is not a use) but are never evicted or freed until settled.
        self._writing: dict[int, tuple[Page, float]] = {}

    def queue(self, key: str, now: float) -> None:
        self._queued[key] = now

    def discard(self, key: str) -> bool:
        """Forget a queued page (dropped, or the tier below has it already); whether it was queued."""
        return self._queued.pop(key, None) is not None

    def __contains__(self, key: str) -> bool:
        """Queued, and not handed to the writer yet."""
        return key in self._queued

    def oldest(self, n: int) -> list[str]:
        return list(islice(self._queued, n))

    def begin(self, pages: list[Page]) -> None:
        """The writer takes these queued pages."""
        for page in pages:
            self._writing[page.slot] = (page, self._queued.pop(page.key))

    def end(self, slot: int) -> None:
        del self._writing[slot]

    def is_writing(self, slot: int) -> bool:
        return slot in self._writing

    @property
    def num_writing(self) -> int:
        return len(self._writing)

    def __len__(self) -> int:
        """Pages not in the tier below yet: queued or being written."""
        return len(self._queued) + len(self._writing)

    def oldest_since(self) -> float | None:
        """Commit time of the oldest page not yet in the tier below (write-behind lag)."""
        times = [*(t for _, t in self._writing.values()), *islice(self._queued.values(), 1)]
        return min(times) if times else None
