"""SlotTable: which slots of a pool are free, each slot's generation, and the slots never to be
handed out again. Pure: no memory, no I/O; kvcr/proto/pool.py decides what goes in them."""

from __future__ import annotations


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.capacity = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._generation = [0] * num_slots
        self._quarantined: list[int] = []  # slots a cancelled transfer may still write

    def take(self) -> tuple[int, int]:
        """A free slot and its new generation (raises IndexError when none is free)."""
        slot = self._free.pop()
        self._generation[slot] += 1
        return slot, self._generation[slot]

    def free(self, slot: int) -> None:
        """The slot's bytes are no one's: a new generation, so a page from the old one is stale."""
        self._generation[slot] += 1
        self._free.append(slot)

    def quarantine(self, slot: int) -> None:
        self._quarantined.append(slot)

    def generation(self, slot: int) -> int:
        return self._generation[slot]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantined)
