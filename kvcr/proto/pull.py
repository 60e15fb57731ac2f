"""A peer pull, decided: the claim's answer, the transfer plan, the release and what was delivered.

Pure (h11-style): `Pull` takes what happened (the source's answer, the transfer's outcome, the
release's answer) with `now` passed in, and answers with actions for the driver to perform
(`kvcr/drivers/puller.py`). A pull is one claim round trip, one transfer straight into the
destination buffers, then a release whose answer says which claimed slots kept their bytes.
Only the leading pages whose bytes arrived and whose slot stayed live are delivered.
"""

from __future__ import annotations

import enum
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence, Union

from . import messages as m
from .claims import MAX_LEASE_S


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

    def chunk_end(offset: int) -> int:
        """Where the chunk holding `offset` ends (-1: in none; nothing is merged into that GET)."""
        i = bisect_right(lows, offset) - 1
        return bounds[i][1] if i >= 0 and offset < bounds[i][1] else -1

    ops: list[GetOp] = []
    run: list = []  # the GET being grown: local, nbytes, remote, its pages, where its chunk ends
    for dst, size, src, page in pieces:
        if (run and run[0] + run[1] == dst and run[2] + run[1] == src and run[1] + size <= max_op_bytes
                and src + size <= run[4]):
            run[1] += size
            if run[3][-1] != page:
                run[3].append(page)
            continue
        if run:
            ops.append(GetOp(run[0], run[1], run[2], tuple(run[3])))
        run = [dst, size, src, [page], chunk_end(src)]
    if run:
        ops.append(GetOp(run[0], run[1], run[2], tuple(run[3])))
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


# --- the pull's lifecycle -----------------------------------------------------------------------

LEASE_MARGIN = 0.2  # of the lease: slack for clock-rate differences between us and the source
LATE_GRANT_WAIT_S = 30.0  # how long a late grant is waited for when we asked for no particular lease
OUTSIDE_REGISTERED = "pages outside the memory the source had registered when we connected"
TRANSPORTS = ("get", "tag", "shm", "auto")


class PeerError(RuntimeError):
    """A peer that cannot serve pulls (no UCX, incompatible protocol, refused namespace...)."""


class NoPuller(RuntimeError):
    """This runner pulls from no peer (runner.ucx = false)."""


class PullStateError(RuntimeError):
    """An event the pull cannot take in its state (a driver bug, never a peer's doing)."""


class PullState(enum.Enum):
    CLAIMING = "claiming"    # the claim is sent; no answer yet
    HELD = "held"            # granted: the source pins the pages for us until the lease ends
    MOVING = "moving"        # the transfer runs
    RELEASING = "releasing"  # the release is sent and its answer (which slots stayed live) awaited
    DONE = "done"            # over: the claim is given back (or left to its lease) and the result final


@dataclass(frozen=True, slots=True)
class PullResult:
    delivered: int            # leading pages now in the destination buffers, intact
    uncertain: bool = False   # some buffers may still be written: do not reuse them
    error: str = ""


@dataclass(frozen=True, slots=True)
class SourceTerms:
    """What a source told us when we connected; a grant is judged against it."""

    incarnation: str
    page_bytes: Mapping[str, int]  # per pool
    chunks: tuple[tuple[int, int], ...]  # registered (offset, length) of its region
    can_move: bool = False


@dataclass(frozen=True, slots=True)
class PullTerms:
    """What we ask for."""

    pool: str
    asked: int                      # pages claimed
    page_bytes: int | None = None   # ours: a source must match (None: take its size)
    digests: bool = False           # ask for a digest per page and check the received bytes
    lease_s: float = 0.0            # 0: the source's default
    retried: bool = False           # this is the one claim made again after a stale view


# Actions: what the driver performs, in order.
@dataclass(frozen=True, slots=True)
class SendRelease:
    claim_id: int
    drop: int = 0       # move mode: the source drops its copies of this many leading pages
    wait: bool = True   # wait for the answer (the pull learns which slots stayed live)


@dataclass(frozen=True, slots=True)
class ClaimAgain:
    """Our view of the source is stale (it restarted or registered more): learn it afresh, claim once more."""

    reason: str


@dataclass(frozen=True, slots=True)
class BackOff:
    """The source did not answer: skip it for a while and give back a grant it sends late."""

    until: float  # when a late grant can no longer come


@dataclass(frozen=True, slots=True)
class Refuse:
    """This source must not be used (namespace, pieces that do not fit): raise PeerError."""

    reason: str


@dataclass(frozen=True, slots=True)
class Transfer:
    ops: tuple[GetOp, ...]
    digests: bool  # hand back a digest of every destination page afterwards


@dataclass(frozen=True, slots=True)
class CopyInline:
    """The pages came with the grant: copy them out of `data` (ops' remote offsets index it)."""

    ops: tuple[GetOp, ...]
    data: bytes
    digests: bool  # hand back a digest of every destination page afterwards


@dataclass(frozen=True, slots=True)
class ForgetSource:
    """The transfer failed: the next pull reconnects (a fresh endpoint, a fresh view)."""

    reason: str


@dataclass(frozen=True, slots=True)
class DigestMismatch:
    page: int  # the first page whose bytes differ from the source's commit digest


@dataclass(frozen=True, slots=True)
class Finish:
    result: PullResult


Action = Union[SendRelease, ClaimAgain, BackOff, Refuse, Transfer, CopyInline, ForgetSource, DigestMismatch, Finish]

MISS = Finish(PullResult(0))

_ALLOWED: dict[str, tuple[PullState, ...]] = {  # event -> states that take it
    "granted": (PullState.CLAIMING,),
    "claim_refused": (PullState.CLAIMING,),
    "claim_timed_out": (PullState.CLAIMING,),
    "plan": (PullState.HELD,),
    "moved": (PullState.MOVING,),
    "move_failed": (PullState.MOVING,),
    "release_answered": (PullState.RELEASING,),
    "cancel": tuple(PullState),
}


def pages_inside(offsets: Sequence[int], length: int, chunks: Sequence[tuple[int, int]]) -> bool:
    """Whether every page (`length` bytes at each offset) lies in one of the (start, length) chunks."""
    def inside(start: int, end: int) -> bool:
        return any(c_start <= start and end <= c_start + c_length for c_start, c_length in chunks)
    if not offsets or inside(min(offsets), max(offsets) + length):
        return True  # the whole span in one chunk (a claim's usual case: one check, not one per page)
    return all(inside(o, o + length) for o in offsets)


def check_grant(reply: m.Granted, terms: PullTerms, source: SourceTerms) -> str:
    """The problem with a grant, or "" when it can be used as it stands."""
    theirs = source.page_bytes.get(terms.pool)
    if terms.page_bytes is not None and theirs != terms.page_bytes:
        return f"pool {terms.pool!r} pages are {theirs} bytes there, {terms.page_bytes} here"
    if len(reply.offsets) > terms.asked or (reply.offsets and min(reply.offsets) < 0):
        return "offsets are not one non-negative integer per page asked for"
    if terms.digests and len(reply.digests) != len(reply.offsets):
        return "digests were asked for but not given for every page"
    if not 0 < reply.lease_s <= MAX_LEASE_S:
        return f"lease {reply.lease_s!r} is not a duration"
    if theirs is None:
        return OUTSIDE_REGISTERED  # a pool its info did not list: look again
    if reply.data:
        if len(reply.data) != len(reply.offsets) * theirs:
            return f"{len(reply.data)} inline bytes are not {len(reply.offsets)} pages of {theirs}"
        return ""  # read at the source under the claim: nothing of its region is addressed
    if not pages_inside(reply.offsets, theirs, source.chunks):
        return OUTSIDE_REGISTERED
    return ""


def late_grant_release(reply: m.Message) -> SendRelease | None:
    """A claim granted after we stopped waiting: nobody will read those pages, so it goes back now
    rather than at its lease end."""
    if isinstance(reply, m.Granted) and reply.offsets and not reply.data:  # with its bytes it ended already
        return SendRelease(reply.claim_id, wait=False)
    return None


def choose_transport(requested: str, on_same_host: Callable[[], bool]) -> str:
    """The transport a pull from this source uses: "auto" copies on the same host, else GETs.
    `on_same_host` is asked only for "auto" (it reads the host's identity)."""
    if requested == "auto":
        return "shm" if on_same_host() else "get"
    return requested


@dataclass
class Pull:
    """One pull from one source, from the claim sent to the claim given back."""

    terms: PullTerms
    source: SourceTerms
    sent: float  # when the claim was sent: the lease cannot have started before
    state: PullState = PullState.CLAIMING
    claim_id: int = 0
    offsets: tuple[int, ...] = ()
    digests: tuple[int, ...] = ()
    data: bytes = b""  # the pages' bytes, when the grant carried them (the claim ended at the source)
    deadline: float = 0.0  # the lease cannot have ended before this
    released: bool = False
    _ops: tuple[GetOp, ...] = ()
    _pages: int = 0          # pages the transfer carries
    _move: bool = False      # ask the source to drop what we verifiably received
    _done: tuple[bool, ...] = ()
    _arrived: int = 0
    _in_lease: bool = False
    _uncertain: bool = False
    _error: str = ""

    @property
    def num_pages(self) -> int:
        return len(self.offsets)

    @property
    def page_bytes(self) -> int:
        return self.source.page_bytes[self.terms.pool]

    def lease_over(self, now: float) -> bool:
        """Whether the source may have ended the claim by its lease (what the claim pins is gone)."""
        return self.state is not PullState.CLAIMING and now >= self.deadline

    def _enter(self, event: str) -> None:
        if self.state not in _ALLOWED[event]:
            raise PullStateError(f"a pull in state {self.state.value} cannot take {event!r}")

    def _release(self, *, drop: int = 0, wait: bool = True) -> list[Action]:
        if self.released or not self.offsets:
            return []
        self.released = True
        return [SendRelease(self.claim_id, drop, wait)]

    # --- the claim's answer ---------------------------------------------------------------------

    def granted(self, reply: m.Granted, now: float) -> list[Action]:
        self._enter("granted")
        self.claim_id, self.offsets = reply.claim_id, tuple(reply.offsets)
        # With the bytes inline the source read the pages under the claim and ended it: whatever
        # we make of the answer, there is nothing to give back.
        self.released = bool(reply.data)
        if reply.incarnation != self.source.incarnation:
            return self._stale("the source restarted: its region and keys are new")
        if not reply.offsets:
            self.state = PullState.DONE
            return [MISS]
        problem = check_grant(reply, self.terms, self.source)
        if problem:  # a source that answers nonsense gets nothing from us but its claim back
            if problem == OUTSIDE_REGISTERED:  # it registered more since we asked: look again
                return self._stale(problem)
            return [*self._end_claim(), Finish(PullResult(0, error=f"claim reply refused: {problem}"))]
        self.digests = tuple(reply.digests)
        self.deadline = self.sent + reply.lease_s
        self.state = PullState.HELD
        self.data = reply.data
        return []

    def _stale(self, reason: str) -> list[Action]:
        actions = self._end_claim()  # still stale after a fresh look: forget it, a later pull starts afresh
        return actions + ([ForgetSource(reason), MISS] if self.terms.retried else [ClaimAgain(reason)])

    def _end_claim(self) -> list[Action]:
        actions = self._release()
        self.state = PullState.DONE
        return actions

    def claim_refused(self, code: str, message: str) -> list[Action]:
        self._enter("claim_refused")
        self.state = PullState.DONE
        return [Refuse(message)] if code == "namespace" else [Finish(PullResult(0, error=message))]

    def claim_timed_out(self, now: float) -> list[Action]:
        """Stalled or gone: skipped for a while; a grant it sends late is given straight back."""
        self._enter("claim_timed_out")
        self.state = PullState.DONE
        return [BackOff(now + (self.terms.lease_s or LATE_GRANT_WAIT_S)), MISS]

    # --- the transfer ---------------------------------------------------------------------------

    def plan(self, destinations: Sequence[Segments], segment_bytes: Sequence[int], *, slice_offset: int = 0,
             move: bool = False) -> list[Action]:
        """GETs of the confirmed pages into `destinations` (per page, the addresses of its pieces of
        `segment_bytes`; from `slice_offset` on, for one TP rank's shard of a page). With `move` the
        release asks the source to drop its copies of what we verifiably received."""
        self._enter("plan")
        n = min(self.num_pages, len(destinations))
        whole = slice_offset == 0 and sum(segment_bytes) == self.page_bytes
        if (slice_offset < 0 or slice_offset + sum(segment_bytes) > self.page_bytes
                or (not whole and (self.digests or move))):
            reason = (f"pieces of {sum(segment_bytes)} bytes from byte {slice_offset} do not fit a page of "
                      f"{self.page_bytes} (or a slice was asked with digests or move)")
            return [*self._end_claim(), Refuse(reason)]
        # Inline bytes: the claim is over, so a move cannot ask the source to drop anything.
        self._pages, self._move = n, move and self.source.can_move and not self.data
        # Pieces come from the answer's bytes (page i at i * page_bytes) or from the source's region.
        starts, chunks = ([i * self.page_bytes for i in range(n)], ((0, len(self.data)),)) if self.data else \
            (self.offsets[:n], self.source.chunks)
        self._ops = tuple(plan_segment_gets(destinations[:n], [o + slice_offset for o in starts], segment_bytes,
                                            chunks=chunks))
        self.state = PullState.MOVING
        if self.data:
            return [CopyInline(self._ops, self.data, bool(self.digests))]
        return [Transfer(self._ops, bool(self.digests))]

    def moved(self, done: Sequence[bool], now: float, *, error: str = "", uncertain: bool = False,
              digests: Sequence[int] = ()) -> list[Action]:
        """The transfer ended (`done` per op); `digests`: of every destination page, when asked."""
        self._enter("moved")
        n = self._pages
        self._done, self._error, self._uncertain = tuple(done), error, uncertain
        self._arrived = delivered_prefix(self._ops, self._done, (True,) * n, n)
        actions: list[Action] = []
        if self.digests:
            bad = next((i for i in range(self._arrived) if i >= len(digests) or digests[i] != self.digests[i]), None)
            if bad is not None:
                self._arrived = bad
                actions.append(DigestMismatch(bad))
        # The source cannot reuse a claimed slot before the lease ends, and our deadline was taken
        # before the source started the lease. A transfer that ended well inside it read the claimed
        # bytes, so the release need not be waited for; a late end asks the source (generations).
        # Inline bytes were read under the claim, at the source: they are the claimed bytes whenever copied.
        self._in_lease = bool(self.data) or now < self.deadline - LEASE_MARGIN * (self.deadline - self.sent)
        drop = self._arrived if self._move and not uncertain else 0
        wait = bool(drop) or not self._in_lease  # a move changes the source: know its answer
        release = self._release(drop=drop, wait=wait)
        actions += release
        if error:
            actions.append(ForgetSource(error))
        if release and wait:
            self.state = PullState.RELEASING
            return actions
        self.state = PullState.DONE
        return actions + [Finish(self._result(()))]

    def move_failed(self, error: str) -> list[Action]:
        """The transfer raised: nothing proves it stopped writing, so the buffers are uncertain."""
        self._enter("move_failed")
        return [*self._end_claim(), Finish(PullResult(0, True, error))]

    def release_answered(self, live: Sequence[bool]) -> list[Action]:
        """The release's answer: per page, whether the slot stayed live (empty: no answer)."""
        self._enter("release_answered")
        self.state = PullState.DONE
        return [Finish(self._result(tuple(live)))]

    def _result(self, live: tuple[bool, ...]) -> PullResult:
        n = self._pages
        if not live and self._in_lease:
            # No release answer (not asked, or the source died), but the transfer ended inside the
            # lease: the source could not have reused those slots, so what arrived is what was claimed.
            live = (True,) * n
        delivered = min(self._arrived, delivered_prefix(self._ops, self._done, live, n))
        return PullResult(delivered, self._uncertain, self._error)

    def cancel(self, *, wait: bool = True) -> list[Action]:
        """Give the claim back unused (idempotent): nothing is delivered."""
        self._enter("cancel")
        if self.state is PullState.CLAIMING:
            raise PullStateError("a claim not yet answered cannot be cancelled")
        actions = self._release(wait=wait)
        if self.state is not PullState.RELEASING:
            self.state = PullState.DONE
        return actions
