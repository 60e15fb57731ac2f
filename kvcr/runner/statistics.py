"""What a runner counts, gathered in one go under its lock (metrics, the worker's view, tests)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from ..proto.claims import ClaimStats
from ..proto.disk_index import DiskStats
from ..proto.pool import PagePool, PoolStats
from .lower import LowerTier, TieringStatistics


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """One pool's tiers at one moment."""

    dram: PoolStats
    evicted: int                 # DRAM pages evicted for room
    nvme: DiskStats | None       # None: no NVMe tier
    write_behind_queue: int      # dirty pages waiting for the NVMe writer
    write_behind_lag_s: float    # age of the oldest of them (0: none)


@dataclass(frozen=True, slots=True)
class RunnerStatistics:
    """Everything the runner counts, taken under its lock in one go (metrics, the worker's view)."""

    tiers: tuple[TierStatistics, ...]
    claims: ClaimStats
    hits: int
    misses: int
    dropped: tuple[tuple[tuple[str, str, str], int], ...]  # ((pool, tier, reason), pages), sorted
    nvme: TieringStatistics
    unheld_evicted: int = 0     # pages peers claimed that we held and let go before the claim
    unheld_never_held: int = 0  # pages peers claimed that we never held (whoever named us was wrong)

    def tier(self, pool: str) -> TierStatistics:
        return next(t for t in self.tiers if t.dram.name == pool)


def gather_statistics(pools: Mapping[str, PagePool], claims: ClaimStats, lower: LowerTier, now: float, *,
                      hits: int, misses: int, unheld: Counter[str]) -> RunnerStatistics:
    """The caller holds the runner's lock."""
    tiers = tuple(_tier(name, pool, lower, now) for name, pool in pools.items())
    return RunnerStatistics(tiers, claims, hits, misses, tuple(sorted(dropped(pools, lower).items())),
                            lower.statistics(), unheld["evicted"], unheld["never_held"])


def _tier(name: str, pool: PagePool, lower: LowerTier, now: float) -> TierStatistics:
    below = name in lower.pools
    since = pool.oldest_dirty_since() if below else None
    return TierStatistics(pool.statistics(), pool.num_evicted, lower.index_statistics(name),
                          pool.num_dirty if below else 0, 0.0 if since is None else max(0.0, now - since))


def dropped(pools: Mapping[str, PagePool], lower: LowerTier) -> dict[tuple[str, str, str], int]:
    """Pages a tier let go that no tier below kept: (pool, tier, reason) -> count."""
    out = {(name, "dram", reason): n for name, p in pools.items() for reason, n in p.dropped.items()}
    out.update({(name, "nvme", "evicted"): n for name, n in lower.evicted().items()})
    return out
