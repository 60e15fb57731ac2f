"""Planning a peer pull, and deciding what it delivered. Pure: no sockets, no UCX.

A pull is one claim round trip, then one-sided GETs straight into the destination buffers,
then a release whose answer says which claimed slots kept their bytes. Only the leading pages
whose GET completed and whose slot stayed live are delivered; everything else is a miss.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True, slots=True)
class GetOp:
    local: int           # destination address
    nbytes: int
    remote_offset: int   # within the source's registered region
    pages: tuple[int, ...]  # which requested pages this GET carries


Segments = Sequence[int]  # a page's destination addresses, one per segment (one for a contiguous page)


def plan_gets(local: Sequence[int], remote: Sequence[int], page_bytes: int, *, chunks: Sequence[tuple[int, int]],
              max_op_bytes: int = 32 << 20) -> list[GetOp]:
    """One GET per run of pages adjacent on both sides (and inside one registered chunk)."""
    return _merge(((dst, page_bytes, src, i) for i, (dst, src) in enumerate(zip(local, remote))), chunks,
                  max_op_bytes)


def plan_segment_gets(local: Sequence[Segments], remote: Sequence[int], segment_bytes: Sequence[int], *,
                      chunks: Sequence[tuple[int, int]], max_op_bytes: int = 32 << 20) -> list[GetOp]:
    """GETs for pages whose destination is split into segments (an engine's K and V, or per-layer
    slices): segment k of page i comes from remote[i] + the sizes of segments before k."""
    starts = [sum(segment_bytes[:k]) for k in range(len(segment_bytes))]
    return _merge(((dst, size, src + at, i) for i, (dests, src) in enumerate(zip(local, remote))
                   for dst, size, at in zip(dests, segment_bytes, starts)), chunks, max_op_bytes)


def _merge(pieces: Iterable[tuple[int, int, int, int]], chunks: Sequence[tuple[int, int]],
           max_op_bytes: int) -> list[GetOp]:
    """(local, nbytes, remote, page) pieces in order; pieces adjacent on both sides and inside one
    registered chunk share one GET."""
    bounds = sorted((start, start + length) for start, length in chunks)
    lows = [b[0] for b in bounds]

    def chunk_of(offset: int) -> int:
        i = bisect_right(lows, offset) - 1
        return i if i >= 0 and offset < bounds[i][1] else -1

    ops: list[GetOp] = []
    for dst, size, src, page in pieces:
        if ops:
            last = ops[-1]
            if (last.local + last.nbytes == dst and last.remote_offset + last.nbytes == src
                    and last.nbytes + size <= max_op_bytes and chunk_of(src) == chunk_of(last.remote_offset)
                    and chunk_of(src + size - 1) == chunk_of(src)):
                pages = last.pages if last.pages[-1] == page else (*last.pages, page)
                ops[-1] = GetOp(last.local, last.nbytes + size, last.remote_offset, pages)
                continue
        ops.append(GetOp(dst, size, src, (page,)))
    return ops


def delivered_prefix(ops: Sequence[GetOp], done: Sequence[bool], live: Sequence[bool], num_pages: int) -> int:
    """Leading pages whose GETs (all of them) completed and whose source slot stayed live for the whole claim."""
    arrived: list[bool | None] = [None] * num_pages
    for op, ok in zip(ops, done):
        for page in op.pages:
            arrived[page] = ok if arrived[page] is None else arrived[page] and ok
    n = 0
    while n < num_pages and arrived[n] and n < len(live) and live[n]:
        n += 1
    return n


def split_even(ops: list[tuple[int, int, int]], lanes: int) -> list[tuple[int, int, int, int, int]]:
    """(lane, op index, local, nbytes, remote) pieces of (local, nbytes, remote) ops, cut at 4 KiB-
    aligned points so every lane (a thread moving its share) gets about the same number of bytes."""
    total = sum(n for _, n, _ in ops)
    share = ((total + lanes - 1) // lanes + 4095) // 4096 * 4096 if lanes > 1 else total or 1
    pieces, lane, filled = [], 0, 0
    for index, (local, nbytes, remote) in enumerate(ops):
        done = 0
        while done < nbytes:
            take = min(nbytes - done, share - filled) if lanes > 1 else nbytes
            pieces.append((lane, index, local + done, take, remote + done))
            done += take
            filled += take
            if lanes > 1 and filled >= share and lane < lanes - 1:
                lane, filled = lane + 1, 0
    return pieces
