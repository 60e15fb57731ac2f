"""Pages assembled from TP shards in a runner's pool: the ranks join one fill (see proto/shards.py).

Its own locks, taken before the runner's and never while holding it: `_opening` serialises the
find-or-open of a group across the runner's reserve (which may wait for the NVMe writer), so two
ranks never open two fills for one batch; `_lock` guards the groups and is held only briefly, so a
rank committing its shard never waits behind another rank's reserve.
"""

from __future__ import annotations

import threading
from typing import Iterable, Protocol, Sequence

from ..proto.announce import Announce
from ..proto.claims import Fill
from ..proto.keys import StorageKey
from ..proto.shards import ShardGroups, check_shard

SHARD_OWNER = "shards"  # owns the fills TP ranks assemble together


class Fills(Protocol):
    """What shard assembly asks of the DRAM core: its fills, and each pool's page geometry."""

    def page_geometry(self, pool: str) -> tuple[int, int]: ...  # (page bytes, shards per page)
    def reserve(self, pool: str, keys: Sequence[StorageKey], announces: Sequence[Announce | None] | None = None, *,
                owner: str = "local", lease_s: float | None = None, writer_pid: int = 0) -> Fill: ...
    def fill(self, fill_id: int) -> Fill: ...
    def commit(self, fill_id: int, ok: Sequence[bool] | None = None, *, owner: str = "local",
               clean: bool = False) -> int: ...


class ShardAssembly:
    def __init__(self, fills: Fills) -> None:
        self.fills = fills
        self._groups = ShardGroups()
        self._fills: dict[int, Fill] = {}
        self._opening = threading.Lock()
        self._lock = threading.Lock()

    def reserve(self, pool: str, keys: Sequence[StorageKey], shard: int,
                announces: Sequence[Announce | None] | None = None, *, lease_s: float | None = None
                ) -> tuple[Fill, int]:
        """Join (or open) the fill assembling exactly `keys`; returns it and the byte offset of
        `shard` inside each page. The first rank's announces are the page's."""
        page_bytes, shards = self.fills.page_geometry(pool)
        check_shard(shard, shards)  # before a group is opened for it
        batch = tuple(keys)
        with self._lock:
            fill = self._join(pool, batch, shard)
        if fill is None:
            with self._opening:
                with self._lock:  # opened while this rank waited for `_opening`?
                    fill = self._join(pool, batch, shard)
                if fill is None:
                    fill = self.fills.reserve(pool, keys, announces, owner=SHARD_OWNER, lease_s=lease_s)
                    with self._lock:
                        self._groups.join(self._groups.open(pool, batch, fill.fill_id, shards), shard)
                        self._fills[fill.fill_id] = fill
        self.fills.fill(fill.fill_id)  # a group whose fill just expired: raises, naming why
        return fill, shard * (page_bytes // shards)

    def _join(self, pool: str, batch: tuple[StorageKey, ...], shard: int) -> Fill | None:
        group = self._groups.find(pool, batch)
        if group is None:
            return None
        self._groups.join(group, shard)
        return self._fills[group.fill_id]

    def commit(self, fill_id: int, shard: int, ok: bool) -> bool | None:
        """One shard written (or failed). The pages are committed once every shard is in, and
        discarded as soon as one fails. Returns that verdict (None: others still writing)."""
        with self._lock:
            _, verdict = self._groups.commit(fill_id, shard, ok)
            fill = self._fills.pop(fill_id) if verdict is not None else None
        if fill is not None:
            self.fills.commit(fill_id, None if verdict else [False] * len(fill.pages), owner=SHARD_OWNER)
        return verdict

    def forget(self, fill_ids: Iterable[int]) -> None:
        """Fills that expired: a rank never wrote its shard, so the pages are gone with the fill."""
        with self._lock:
            for fill_id in fill_ids:
                self._groups.close(fill_id)
                self._fills.pop(fill_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)
