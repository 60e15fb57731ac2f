"""How a runner's region is carved into pools: where each pool starts, its slots' stride, its
namespace. Fixed when the runner starts."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config
from ..proto.keys import Namespace


@dataclass(frozen=True, slots=True)
class PoolLayout:
    name: str
    offset: int
    stride: int
    page_bytes: int
    num_slots: int
    namespace: Namespace
    shards: int = 1  # TP shards side by side in a page (a sidecar's pool)


def round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def plan_layout(cfg: Config) -> list[PoolLayout]:
    """Carve dram.size into pools; each slot starts on a dram.alignment boundary."""
    align = cfg.dram.alignment
    layouts, offset = [], 0
    for pool in cfg.dram.pools:
        size = cfg.pool_sizes()[pool.name]
        stride = round_up(pool.page_bytes, align)
        layouts.append(PoolLayout(pool.name, offset, stride, pool.page_bytes, size // stride,
                                  cfg.namespace_for(pool), pool.shards))
        offset = round_up(offset + size, align)
    return layouts
