"""Pages assembled from tensor-parallel shards (pure).

With TP > 1 each rank holds its own slice of every page's heads. A sidecar runner keeps a page as
all its shards side by side; every rank writes its own slice of the same fill. The page becomes
READY (and is announced) only when every shard committed; one failed shard, or a rank that never
commits before the fill's lease ends, discards the whole page. So no page is ever visible with a
shard missing, and a page's shards are evicted together (they are one page).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ShardError(ValueError):
    pass


def check_shard(shard: int, shards: int) -> None:
    if not 0 <= shard < shards:
        raise ShardError(f"shard {shard} is outside 0..{shards - 1}")


@dataclass
class ShardGroup:
    fill_id: int
    shards: int
    joined: set[int] = field(default_factory=set)
    committed: dict[int, bool] = field(default_factory=dict)


class ShardGroups:
    """Open fills keyed by (pool, the exact keys): ranks back up the same batch, so they join it."""

    def __init__(self) -> None:
        self._by_keys: dict[tuple[str, tuple[str, ...]], ShardGroup] = {}
        self._by_fill: dict[int, tuple[str, tuple[str, ...]]] = {}

    def find(self, pool: str, keys: tuple[str, ...]) -> ShardGroup | None:
        return self._by_keys.get((pool, keys))

    def open(self, pool: str, keys: tuple[str, ...], fill_id: int, shards: int) -> ShardGroup:
        group = self._by_keys[(pool, keys)] = ShardGroup(fill_id, shards)
        self._by_fill[fill_id] = (pool, keys)
        return group

    @staticmethod
    def join(group: ShardGroup, shard: int) -> None:
        check_shard(shard, group.shards)
        if shard in group.joined:
            raise ShardError(f"shard {shard} already writes fill {group.fill_id}")
        group.joined.add(shard)

    def commit(self, fill_id: int, shard: int, ok: bool) -> tuple[ShardGroup, bool | None]:
        """Record one shard's outcome. Returns the group and the verdict: True (every shard is in:
        commit the fill), False (a shard failed: discard it), None (others still writing)."""
        group = self.group_of(fill_id)
        if shard not in group.joined:
            raise ShardError(f"shard {shard} never joined fill {fill_id}")
        if shard in group.committed:
            raise ShardError(f"shard {shard} already committed fill {fill_id}")
        group.committed[shard] = ok
        if not ok:
            self.close(fill_id)
            return group, False
        if len(group.committed) == group.shards:
            self.close(fill_id)
            return group, True
        return group, None

    def group_of(self, fill_id: int) -> ShardGroup:
        where = self._by_fill.get(fill_id)
        if where is None:
            raise ShardError(f"fill {fill_id} is not being assembled (done, failed or expired)")
        return self._by_keys[where]

    def close(self, fill_id: int) -> None:
        where = self._by_fill.pop(fill_id, None)
        if where is not None:
            del self._by_keys[where]

    def __len__(self) -> int:
        return len(self._by_fill)
