"""Planning a peer pull, and deciding what it delivered. Pure: no sockets, no UCX.

A pull is one claim round trip, then one-sided GETs straight into the destination buffers,
then a release whose answer says which claimed slots kept their bytes. Only the leading pages
whose GET completed and whose slot stayed live are delivered; everything else is a miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class GetOp:
    local: int           # destination address
    nbytes: int
    remote_offset: int   # within the source's registered region
    pages: tuple[int, ...]  # which requested pages this GET carries


def plan_gets(local: Sequence[int], remote: Sequence[int], page_bytes: int, *, chunks: Sequence[tuple[int, int]],
              max_op_bytes: int = 32 << 20) -> list[GetOp]:
    """One GET per run of pages adjacent on both sides (and inside one registered chunk)."""
    def chunk_of(offset: int) -> int:
        return next((i for i, (start, length) in enumerate(chunks) if start <= offset < start + length), -1)

    ops: list[GetOp] = []
    for i, (dst, src) in enumerate(zip(local, remote)):
        if ops:
            last = ops[-1]
            if (last.local + last.nbytes == dst and last.remote_offset + last.nbytes == src
                    and last.nbytes + page_bytes <= max_op_bytes and chunk_of(src) == chunk_of(last.remote_offset)
                    and chunk_of(src + page_bytes - 1) == chunk_of(src)):
                ops[-1] = GetOp(last.local, last.nbytes + page_bytes, last.remote_offset, (*last.pages, i))
                continue
        ops.append(GetOp(dst, page_bytes, src, (i,)))
    return ops


def delivered_prefix(ops: Sequence[GetOp], done: Sequence[bool], live: Sequence[bool], num_pages: int) -> int:
    """Leading pages whose GET completed and whose source slot stayed live for the whole claim."""
    arrived = [False] * num_pages
    for op, ok in zip(ops, done):
        for page in op.pages:
            arrived[page] = ok
    n = 0
    while n < num_pages and arrived[n] and n < len(live) and live[n]:
        n += 1
    return n
