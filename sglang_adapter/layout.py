"""Where a page lives in SGLang's host pool: the segments `get_page_buffer_meta` names, in order.

A kvcr page is those segments back to back, so one page is one slot in the runner's pool
whatever the host layout (layer_first: 2 x layers segments; page_first(_direct): K and V; MLA: 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable, Sequence

from kvcr.drivers.memcopy import copy_serial


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


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """What one storage key holds of one host pool: `pages` consecutive host pages (span mode:
    storage_page_size // page_size for KV-like pools; one slot for state pools like Mamba)."""

    page: PageLayout
    pages: int = 1

    @property
    def bytes(self) -> int:
        return self.page.page_bytes * self.pages

    @property
    def segment_bytes(self) -> tuple[int, ...]:
        return self.page.segment_bytes * self.pages

    def key_segments(self, pool, host_indices, num_keys: int) -> list[list[int]]:
        """Per key: its segments' addresses, its `pages` host pages back to back."""
        slots = self.pages * self.page.page_size
        if len(host_indices) != num_keys * slots:
            raise LayoutError(f"{len(host_indices)} host slots for {num_keys} keys; each key takes {slots} "
                              f"({self.pages} page(s) of {self.page.page_size})")
        per_page = self.page.page_segments(pool, host_indices)
        return [[a for page in per_page[k * self.pages:(k + 1) * self.pages] for a in page] for k in range(num_keys)]


def gather(pages: Iterable[tuple[Sequence[int], int]], sizes: Sequence[int]) -> None:
    """Copy each page's segments into contiguous memory at its `dest` ((segments, dest) pairs), as one batch."""
    offsets = _offsets(sizes)
    copy_serial([(dest + offset, size, ptr) for segments, dest in pages
                 for ptr, size, offset in zip(segments, sizes, offsets)])


def scatter(pages: Iterable[tuple[int, Sequence[int]]], sizes: Sequence[int]) -> None:
    """Copy each page's contiguous bytes at `src` out to its segments ((src, segments) pairs), as one batch."""
    offsets = _offsets(sizes)
    copy_serial([(ptr, size, src + offset) for src, segments in pages
                 for ptr, size, offset in zip(segments, sizes, offsets)])


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [0, *accumulate(sizes)][:len(sizes)]
