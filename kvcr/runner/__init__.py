"""The runner layer: what one runner holds and how its tiers meet.

Edges run one way, from the store down:

    store.py      builds the parts and joins them (the service holds a Store)
    ├── dram.py       Runner, the DRAM core: region, pools, claims, the lock
    │   ├── events.py      EventStream: what it changed, published in order; the inventory
    │   ├── layout.py      how the region is carved into pools
    │   └── statistics.py  what it counts, gathered under its lock
    ├── nvme_tier.py  NvmeTier, the tier below DRAM, and its persister.py thread
    └── shards.py     ShardAssembly, TP ranks writing one page together
    lower.py      the interfaces between DRAM and the tier below (and NoLowerTier)

The DRAM core knows the tier below only as a `LowerTier`; the tier and shard assembly know the
core only as `DramSide` and `Fills`.
"""

from .dram import TIER_ABSENT, TIER_DRAM, TIER_NVME, Grant, Runner, UnknownPool
from .layout import PoolLayout, plan_layout
from .lower import DiskStatistics, LowerTier, NoLowerTier, TieringStatistics
from .statistics import RunnerStatistics, TierStatistics
from .store import Store, open_store

__all__ = ["TIER_ABSENT", "TIER_DRAM", "TIER_NVME", "DiskStatistics", "Grant", "LowerTier", "NoLowerTier", "PoolLayout",
           "Runner", "RunnerStatistics", "Store", "TierStatistics", "TieringStatistics", "UnknownPool", "open_store",
           "plan_layout"]
