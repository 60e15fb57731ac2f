"""The store: a runner's DRAM core, the tier below it and shard assembly, built and joined once.

The parts know one another only through the interfaces in lower.py and shards.py; what crosses
between them (expired fills to shard assembly, the tier's pass, the shutdown order) happens here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..config import Config
from ..proto.events import Event
from .dram import Runner
from .layout import plan_layout
from .lower import DramSide, LowerTier, NoLowerTier
from .nvme_tier import NvmeTier
from .shards import ShardAssembly


@dataclass(frozen=True, slots=True)
class Store:
    runner: Runner          # DRAM: region, pools, claims, events
    lower: LowerTier        # NVMe, or NoLowerTier
    shards: ShardAssembly   # TP ranks writing one page together

    def start_scans(self) -> None:
        self.lower.start_scans()

    def housekeeping(self) -> None:
        """Lease expiry (a fill shard ranks were assembling goes with its lease), then the lower
        tier's pass (watermark eviction, a dead writer restarted)."""
        self.shards.forget(self.runner.expire())  # shard assembly's lock is never taken under the runner's
        self.lower.housekeeping()

    def healthy(self) -> bool:
        return self.lower.healthy()

    def flush(self) -> tuple[float, int, int]:
        """Write every dirty DRAM page to the lower tier (at shutdown): (seconds, written, left)."""
        return self.lower.flush()

    def shutdown(self) -> None:
        """Flush and close the lower tier (its files stay: a restarted runner re-announces them),
        then announce the removal of everything DRAM held and unmap the region."""
        if self.lower.pools:
            self.lower.flush()
        self.lower.close()
        self.runner.shutdown()


def open_store(cfg: Config, *, publish: Callable[[Sequence[Event]], int] | None = None,
               clock: Callable[[], float] = time.monotonic) -> Store:
    """The store `cfg` describes: an NVMe tier under every pool when nvme.storage_dir is set."""
    if not cfg.nvme.storage_dir:
        runner = Runner(cfg, publish=publish, clock=clock)
        return Store(runner, NoLowerTier(), ShardAssembly(runner))
    made: list[NvmeTier] = []

    def nvme(dram: DramSide) -> LowerTier:  # called by the runner once its lock and pools exist
        made.append(NvmeTier(dram, cfg.nvme, {lay.name: (lay.namespace, lay.page_bytes) for lay in plan_layout(cfg)},
                             block_size=cfg.runner.block_size))
        return made[0]

    runner = Runner(cfg, publish=publish, clock=clock, lower=nvme)
    return Store(runner, made[0], ShardAssembly(runner))
