"""Where a page lives in SGLang's host pool: the segments `get_page_buffer_meta` names, in order.

A kvcr page is those segments back to back, so one page is one slot in the runner's pool
whatever the host layout (layer_first: 2 x layers segments; page_first(_direct): K and V; MLA: 1).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence


class LayoutError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class PageLayout:
    page_size: int                   # tokens per page
    segment_bytes: tuple[int, ...]   # per segment of one page, in order
    layout: str
    dtype: str

    @property
    def page_bytes(self) -> int:
        return sum(self.segment_bytes)

    @classmethod
    def of(cls, pool) -> "PageLayout":
        import torch

        indices = torch.arange(pool.page_size, dtype=torch.int64)
        meta = pool.get_page_buffer_meta(indices)
        if meta is None:
            raise LayoutError("the host pool gives no page buffer descriptors (a logical/hybrid anchor); kvcr "
                              "needs a KV host pool")
        _, sizes = meta
        return cls(pool.page_size, tuple(int(s) for s in sizes), pool.layout, str(pool.dtype).removeprefix("torch."))

    def page_segments(self, pool, host_indices) -> list[list[int]]:
        """Per page: the addresses of its segments (host_indices holds page_size slots per page)."""
        if len(host_indices) % self.page_size:
            raise LayoutError(f"{len(host_indices)} host indices are not whole pages of {self.page_size}")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        n = len(self.segment_bytes)
        if len(ptrs) != n * (len(host_indices) // self.page_size) or tuple(sizes[:n]) != self.segment_bytes:
            raise LayoutError(f"host pool segments changed: {len(ptrs)} segments of {sizes[:n]} for "
                              f"{len(host_indices) // self.page_size} pages, expected {self.segment_bytes} per page")
        return [list(ptrs[i:i + n]) for i in range(0, len(ptrs), n)]


def gather(segments: Sequence[int], sizes: Sequence[int], dest: int) -> None:
    """Copy one page's segments into contiguous memory at `dest`."""
    offset = 0
    for ptr, size in zip(segments, sizes):
        ctypes.memmove(dest + offset, ptr, size)
        offset += size


def scatter(src: int, segments: Sequence[int], sizes: Sequence[int]) -> None:
    """Copy contiguous page bytes at `src` out to the page's segments."""
    offset = 0
    for ptr, size in zip(segments, sizes):
        ctypes.memmove(ptr, src + offset, size)
        offset += size
