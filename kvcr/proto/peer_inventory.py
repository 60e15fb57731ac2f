"""Which peer holds which block, learnt from the peers' event streams (pure).

For engines that pass no hint to storage (stock SGLang behind Dynamo): the destination follows
its peers' events itself and asks the one holding the longest run of the pages it misses.
Blocks are the engines' own event hashes (u64), counted per medium like a router's index; only
the media a runner serves count (a peer's relayed engine tiers are not something it can hand over).
"""

from __future__ import annotations

from .events import RUNNER_MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from .keys import U64_MASK


class PeerInventory:
    def __init__(self) -> None:
        self._held: dict[str, dict[int, set[str | None]]] = {}  # peer -> block -> media holding it

    def apply(self, peer: str, batch: EventBatch) -> None:
        held = self._held.setdefault(peer, {})
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium in RUNNER_MEDIA:
                for h in event.block_hashes:
                    held.setdefault(h & U64_MASK, set()).add(event.medium)
            elif isinstance(event, BlockRemoved) and event.medium in RUNNER_MEDIA:
                for h in event.block_hashes:
                    media = held.get(h & U64_MASK)
                    if media is not None:
                        media.discard(event.medium)
                        if not media:
                            del held[h & U64_MASK]
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def forget(self, peer: str) -> None:
        self._held.pop(peer, None)

    def num_blocks(self, peer: str) -> int:
        return len(self._held.get(peer, ()))

    def best_source(self, hashes: list[int]) -> tuple[str, int] | None:
        """The peer holding the longest leading run of `hashes` (u64), ties to the lower name."""
        best: tuple[str, int] | None = None
        for peer in sorted(self._held):
            held = self._held[peer]
            n = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            if n and (best is None or n > best[1]):
                best = (peer, n)
        return best
