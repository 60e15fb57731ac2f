"""Which pages eviction takes, in which order. Pure: reads a pool's LRU order and pages, changes
nothing (kvcr/proto/pool.py drops what these choose)."""

from __future__ import annotations

from itertools import islice
from typing import Callable, Collection, Iterable, Mapping

from .page import Keep, Page


def victims(lru: Iterable[str], pages: Mapping[str, Page], n: int, protect: Collection[str], *, lower: bool,
            writing: Callable[[int], bool], dirty: bool) -> list[Page]:
    """Up to n unclaimed READY pages (`lru`: those keys, oldest first) outside `protect`, least
    recently used first within each class: CLEAN pages (the tier below keeps them), then pages
    nothing keeps, then (when `dirty`) DIRTY ones. Never a page its writer is reading."""
    if not lower:  # every page is Keep.NONE: plain LRU
        return [pages[k] for k in islice((k for k in lru if k not in protect), n)]
    clean: list[Page] = []
    unkept: list[Page] = []
    queued: list[Page] = []
    for key in lru:
        if len(clean) >= n:
            break
        if key in protect:
            continue
        page = pages[key]
        if writing(page.slot):
            continue
        if page.keep is Keep.CLEAN:
            clean.append(page)
        elif page.keep is not Keep.DIRTY:
            unkept.append(page)
        elif dirty:
            queued.append(page)
    return (clean + unkept + queued)[:n]


def down_to_watermark(lru: Iterable[str], pages: Mapping[str, Page], n: int, protect: Collection[str]) -> list[Page]:
    """Up to n pages in strict LRU order, stopping at the first DIRTY one (it goes once written),
    so a chain loses its tail first however its pages were written."""
    out: list[Page] = []
    for key in lru:
        page = pages[key]
        if len(out) >= n or page.keep is Keep.DIRTY:
            break
        if key not in protect:
            out.append(page)
    return out
