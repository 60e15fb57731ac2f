"""The three ways a pull's bytes move, behind one interface: one-sided UCX GETs, tagged sends the
source makes into receives we posted, and a copy from the source's pool mapped read-only.

Each ends its transfer before it returns (the plane retires a stuck lane's worker), so nothing
writes into the destination afterwards.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Protocol, Sequence

from ..proto import messages as m
from ..proto.pull import GetOp
from .memcopy import Copier
from .peer_source import PeerSource
from .ucx_rma import GetResult

if TYPE_CHECKING:  # the plane loads libucx; a same-host copy needs none of it
    from .ucx_plane import UcxPlane

log = logging.getLogger(__name__)


class Transport(Protocol):
    def move(self, src: PeerSource, claim_id: int, ops: Sequence[GetOp], *, timeout_s: float,
             abandon_s: float) -> GetResult:
        """Move every op's bytes; per op, whether they arrived."""


class RmaGets:
    def __init__(self, plane: UcxPlane) -> None:
        self.plane = plane

    def move(self, src: PeerSource, claim_id: int, ops: Sequence[GetOp], *, timeout_s: float,
             abandon_s: float) -> GetResult:
        return self.plane.get(src.address, src.rkeys, src.region_base,
                              [(op.local, op.nbytes, op.remote_offset) for op in ops],
                              timeout_s=timeout_s, abandon_s=abandon_s)


class TaggedSends:
    """The fallback where one-sided GETs cannot be used: the source sends inside the claim."""

    def __init__(self, plane: UcxPlane) -> None:
        self.plane = plane

    def move(self, src: PeerSource, claim_id: int, ops: Sequence[GetOp], *, timeout_s: float,
             abandon_s: float) -> GetResult:
        base = random.getrandbits(40) << 20  # tags unique to this transfer
        tagged = [(op.local, op.nbytes, base + i) for i, op in enumerate(ops)]
        with src.socket() as client:
            request_id = client.send(m.SendPages(claim_id=claim_id, address=self.plane.pull_address.hex(),
                                                 ops=[[op.remote_offset, op.nbytes, base + i]
                                                      for i, op in enumerate(ops)]))
            answer: list[bool] = []

            def source_answer() -> bool | None:
                if not answer:
                    try:
                        reply = client.poll_reply(request_id)
                    except Exception as exc:  # refused, or a reply we cannot read: nothing more will come
                        log.info("%s did not send: %s", src.endpoint, exc)
                        answer.append(False)
                        return False
                    if reply is not None:
                        answer.append(all(reply.done))
                return answer[0] if answer else None

            return self.plane.receive_tagged(tagged, source_answer, timeout_s=timeout_s, abandon_s=abandon_s)


class SameHostCopies:
    """A memcpy from the source's pool, mapped read-only: it ends before we return, so nothing is
    ever left in flight (no cancel, no uncertainty)."""

    def __init__(self, copier: Copier) -> None:
        self.copier = copier

    def move(self, src: PeerSource, claim_id: int, ops: Sequence[GetOp], *, timeout_s: float,
             abandon_s: float) -> GetResult:
        with src.lock:
            problem = "the source is forgotten" if src.closed else src.map_read_only()
            if problem:
                return GetResult((False,) * len(ops), error=problem)
            base, size = src.region.address, src.region.size
            done = [0 <= op.remote_offset and op.remote_offset + op.nbytes <= size for op in ops]
            self.copier.copy([(op.local, op.nbytes, base + op.remote_offset) for op, ok in zip(ops, done) if ok])
        return GetResult(tuple(done), error="" if all(done) else "a page lies outside the source's pool")
