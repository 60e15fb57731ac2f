"""Pulling pages from a peer runner: performs what `kvcr.proto.pull.Pull` decides.

The destination side of the peer protocol. `confirm` claims at the source and returns exactly how
many leading pages it promised; `deliver` moves them and ends the claim; `release` gives an unused
claim back. Every decision (what a grant is worth, whether a release is waited for, what counts as
delivered) is the pull's; this module only talks to sockets and transports.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import xxhash
import zmq

from ..client import ControlClient, ControlError
from ..config import DEFAULT_INLINE_PULL_BYTES, CurveKeys
from ..proto import messages as m
from ..proto.announce import Announce
from ..proto.pull import (Action, BackOff, ClaimAgain, CopyInline, DigestMismatch, Finish, ForgetSource, PeerError,
                          Pull, PullResult, PullState, PullTerms, Refuse, SendRelease, Transfer, choose_transport,
                          late_grant_release)
from ..proto.reach import Reachability
from .memcopy import Copier
from .peer_source import PeerSource
from .prober import Prober
from .transports import RmaGets, SameHostCopies, TaggedSends, Transport

if TYPE_CHECKING:
    from .ucx_plane import UcxPlane

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 0.5
SENDER_WAIT_S = 0.01  # the release sender's wait for one source's socket before it looks at others
LATE_POLL_S = 0.2     # how often a timed-out claim's socket is read for the late grant

__all__ = ["Confirmation", "PeerError", "PeerSource", "PullResult", "Puller", "Reachability"]


@dataclass
class Confirmation:
    """A claim held at a source for the leading `num_pages` of a request's pages. It has one owner
    at a time (the thread that delivers or releases it; ClaimHolder hands it over under its
    lock): its pull is not guarded against two threads."""

    source: PeerSource
    pull: Pull
    raw_announces: list  # wire form; decoded only by a puller that publishes what it receives

    pool = property(lambda self: self.pull.terms.pool)
    claim_id = property(lambda self: self.pull.claim_id)
    offsets = property(lambda self: self.pull.offsets)
    digests = property(lambda self: self.pull.digests)
    num_pages = property(lambda self: self.pull.num_pages)
    page_bytes = property(lambda self: self.pull.page_bytes)
    deadline = property(lambda self: self.pull.deadline)
    sent = property(lambda self: self.pull.sent)
    released = property(lambda self: self.pull.released)

    def lease_over(self, now: float) -> bool:
        return self.pull.lease_over(now)

    def announces(self) -> list[Announce | None]:
        return [Announce.from_wire(a) if a is not None else None for a in self.raw_announces]


_AGAIN = object()  # _perform's answer to ClaimAgain


@dataclass
class Puller:
    plane: UcxPlane | None
    namespaces: dict[str, dict] = field(default_factory=dict)  # pool -> our namespace fields
    timeout_s: float = 5.0
    abandon_s: float = 5.0
    # Claims and info requests: a source that answers takes milliseconds; one that does not must
    # not hold the engine's prefetch thread for a transfer's deadline.
    control_timeout_s: float = 2.0
    # A source that did not answer is skipped (a miss) during its back-off, and probed in the
    # background meanwhile: the first answer ends the back-off (docs/reliability.md).
    reach: Reachability = field(default_factory=Reachability)
    lease_s: float = 0.0
    trusted: frozenset[str] | None = None  # endpoints we may pull from; None: any
    insecure: bool = False  # keyless sources over TCP too (runner.insecure); else only over their same-host socket
    curve: CurveKeys | None = None
    verify_transfer_bytes: bool = False  # per-page digest from the source, checked after the transfer
    page_bytes: dict[str, int] = field(default_factory=dict)  # our page size per pool: a source must match
    # "get": one-sided UCX RMA; "tag": the source sends into receives we posted; "shm": copy from the
    # source's pool mapped read-only (same host only); "auto": "shm" on the same host, else "get".
    transport: str = "get"
    copy_threads: int = 0  # same-host copies: threads a large pull is split over (0: one per core, up to 4)
    local_control: bool = True  # a source on this host is asked over its Unix socket, not ZMQ
    # A claim's reply is first waited for without sleeping this long (0: sleep at once): a sleeping
    # thread's wake-up added 27-29 % to a claim and release on a 2-core VM (docs/peer.md).
    reply_spin_s: float = 500e-6
    # A claim of at most this many bytes asks for them in the answer (sources we do not copy from
    # on this host): one round trip instead of a claim, GETs and a release. 0: never.
    inline_max: int = DEFAULT_INLINE_PULL_BYTES
    num_digest_mismatches: int = 0
    num_inline_pages: int = 0  # delivered out of a claim's answer
    num_refused_untrusted: int = 0
    _sources: dict[str, PeerSource] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _reach_lock: threading.Lock = field(default_factory=threading.Lock)
    _prober: Prober = field(init=False)
    _copier: Copier = field(init=False)
    _sender: ThreadPoolExecutor = field(init=False)
    _transports: dict[str, Transport] = field(init=False)

    def __post_init__(self) -> None:
        self._copier = Copier(self.copy_threads)  # threads start on first use
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="kvcr-release")
        self._transports = {"get": RmaGets(self.plane), "tag": TaggedSends(self.plane),
                            "shm": SameHostCopies(self._copier)}
        # A probe waits a few intervals: the source's port may open while it is on its way.
        self._prober = Prober(self.reach, self._reach_lock, curve=self.curve, on_answer=self._came_back,
                              timeout_s=min(self.control_timeout_s, max(4 * self.reach.probe_s, 0.25)))

    # --- sources --------------------------------------------------------------------------------

    def source(self, endpoint: str) -> PeerSource:
        if self.trusted is not None and endpoint not in self.trusted:
            self.num_refused_untrusted += 1
            raise PeerError(f"{endpoint} is not a trusted peer")
        with self._lock:
            src = self._sources.get(endpoint)
            if src is None:
                src = self._sources[endpoint] = self._connect(endpoint)
            return src

    def _connect(self, endpoint: str) -> PeerSource:
        client = ControlClient(endpoint, timeout_s=self.control_timeout_s, curve=self.curve, spin_s=self.reply_spin_s,
                               local=self.local_control)
        try:
            src = PeerSource.describe(endpoint, client, client.info())
            described_locally = client.is_local
            if self.local_control:
                src.go_local()
            if src.client.is_local and not described_locally:
                # What we pull with must come from the socket that vouches for its owner, not from
                # the TCP answer that named that socket (it could name someone else's region).
                src = PeerSource.describe(endpoint, src.client, src.client.info())
        except BaseException:
            client.close()
            raise
        if src.client.curve is None and self.trusted is None and not self.insecure and not src.client.is_local:
            # Nothing vouches for bytes from it: any local user could run a keyless source that
            # answers over TCP and have us store its bytes under our keys.
            src.close()
            self.num_refused_untrusted += 1
            raise PeerError(f"{endpoint} answered over TCP, and without keys a source is trusted only over its "
                            "same-host socket (its user checked): set runner.keys_dir, or list it in runner.peers")
        src.client.on_late_reply = functools.partial(self._late_reply, src)
        return src

    @staticmethod
    def _late_reply(src: PeerSource, reply: m.Message) -> None:
        release = late_grant_release(reply)
        if release is not None:  # we hold src.lock: it goes out as the socket is let go
            src.releases.append(m.ReleaseRequest(claim_id=release.claim_id, quiet=True))

    def _went_down(self, endpoint: str) -> float:
        """`endpoint` did not answer: skipped until the returned time, unless a probe finds it sooner."""
        with self._reach_lock:
            until = self.reach.failed(endpoint, time.monotonic())
        self._prober.wake()
        return until

    def _answered(self, endpoint: str) -> None:
        with self._reach_lock:
            self.reach.answered(endpoint)

    def _came_back(self, endpoint: str, info: dict) -> None:
        """A probe's answer: a connection made to an earlier incarnation would only fail its next claim."""
        with self._lock:
            src = self._sources.get(endpoint)
        if src is not None and info.get("incarnation") not in (None, src.incarnation):
            self._forget_source(src)

    def forget(self, endpoint: str) -> None:
        with self._lock:
            src = self._sources.pop(endpoint, None)
        if src is not None:
            src.close()

    def _forget_source(self, src: PeerSource) -> None:
        """forget(), unless the endpoint is already known by a newer connection."""
        with self._lock:
            current = self._sources.get(src.endpoint) is src
        if current:
            self.forget(src.endpoint)

    def lookup(self, endpoint: str, pool: str, page_hexes: Sequence[str]) -> list[int]:
        src = self.source(endpoint)
        with src.socket() as client:
            return client.request(m.Lookup(pool=pool, keys=list(page_hexes))).tiers

    # --- the pull ---------------------------------------------------------------------------------

    def confirm(self, endpoint: str, pool: str, page_hexes: Sequence[str], *,
                inline: bool = True) -> Confirmation | None:
        """Claim the leading pages at the source. None when it has none, is busy or cannot be
        reached (a miss); PeerError when it must not be used (untrusted, another namespace).
        `inline`: a small claim may take its bytes in the answer (not for a move, whose release
        tells the source what to drop)."""
        with self._reach_lock:
            allowed = self.reach.allow(endpoint, time.monotonic())
        if not allowed:
            return None  # it did not answer lately: a miss now, not another wait
        for retried in (False, True):
            try:
                src = self.source(endpoint)
            except (TimeoutError, OSError, ControlError) as exc:
                log.info("peer %s unreachable (skipped until %.1f): %s", endpoint, self._went_down(endpoint), exc)
                return None
            terms = PullTerms(pool, len(page_hexes), self.page_bytes.get(pool), self.verify_transfer_bytes,
                              self.lease_s, retried)
            pull = Pull(terms, src.terms, sent=time.monotonic())
            reply = None
            try:
                inline_max = self.inline_max if inline and self._transport_for(src) != "shm" else 0
                with src.socket() as client:
                    reply = client.request(m.ClaimRequest(pool=pool, keys=list(page_hexes), lease_s=self.lease_s,
                                                          namespace=self.namespaces.get(pool, {}),
                                                          digests=self.verify_transfer_bytes, inline_max=inline_max))
            except ControlError as exc:
                self._answered(endpoint)
                actions = pull.claim_refused(exc.code, str(exc))
            except m.ProtocolError as exc:  # an answer we cannot read: a grant in it ends by its lease
                self._answered(endpoint)
                actions = pull.claim_refused("bad_reply", f"unreadable claim reply: {exc}")
            except TimeoutError:
                actions = pull.claim_timed_out(time.monotonic())
            except ConnectionError as exc:  # its same-host socket closed: it died, or dropped us
                log.info("claim at %s: %s", endpoint, exc)
                self._forget_source(src)
                actions = pull.claim_timed_out(time.monotonic())
            else:
                self._answered(endpoint)
                actions = pull.granted(reply, time.monotonic())
            outcome = self._perform(src, pull, actions)
            if outcome is _AGAIN:
                continue
            if isinstance(outcome, PullResult) and outcome.error:
                log.info("claim at %s: %s", endpoint, outcome.error)
            if pull.state is not PullState.HELD:
                return None
            if self._transport_for(src) == "shm":
                with src.lock:
                    if not src.closed:
                        src.map_read_only()  # a failure shows at the copy
            return Confirmation(src, pull, reply.announces)
        return None

    def deliver(self, conf: Confirmation, destinations: Sequence[int] | Sequence[Sequence[int]], *,
                segments: Sequence[int] | None = None, slice_offset: int = 0, move: bool = False) -> PullResult:
        """Move the confirmed pages into `destinations`, then end the claim. A destination is a
        page's address, or with `segments` (the byte sizes of a page's pieces, in order) the
        addresses of its pieces: an engine's host page need not be contiguous. With `slice_offset`
        the pieces cover only the bytes from there (one TP rank's shard of a sidecar's page).

        With `move` (only towards sources that advertise it) the release asks the source to drop
        its copies of the pages we verifiably received, and only those."""
        src, pull = conf.source, conf.pull
        n = min(conf.num_pages, len(destinations))
        pieces = [(d,) for d in destinations[:n]] if segments is None else list(destinations[:n])
        sizes = (conf.page_bytes,) if segments is None else tuple(segments)
        actions = pull.plan(pieces, sizes, slice_offset=slice_offset, move=move)
        if isinstance(actions[-1], CopyInline):
            return self._copy_inline(src, pull, actions[-1], pieces, sizes)
        if not isinstance(actions[-1], Transfer):
            return self._perform(src, pull, actions)
        transfer = actions[-1]
        try:
            result = self._transports[self._transport_for(src)].move(src, conf.claim_id, transfer.ops, timeout_s=self.timeout_s,
                                                 abandon_s=self.abandon_s)
        except Exception as exc:
            log.warning("pull from %s failed: %s", src.endpoint, exc)
            return self._perform(src, pull, pull.move_failed(f"{type(exc).__name__}: {exc}"))
        finished = time.monotonic()  # before hashing: the lease check is about when the bytes were read
        digests = _page_digests(pieces, sizes) if transfer.digests else ()
        return self._perform(src, pull, pull.moved(result.done, finished, error=result.error,
                                                   uncertain=result.uncertain, digests=digests))

    def _copy_inline(self, src: PeerSource, pull: Pull, copy: CopyInline, pieces, sizes) -> PullResult:
        """Copy pages that came with the grant out of its bytes (held alive by `copy`)."""
        base = ctypes.cast(ctypes.c_char_p(copy.data), ctypes.c_void_p).value
        try:
            self._copier.copy([(op.local, op.nbytes, base + op.remote_offset) for op in copy.ops])
        except Exception as exc:  # as a failed transfer: nothing of it is delivered
            return self._perform(src, pull, pull.move_failed(f"{type(exc).__name__}: {exc}"))
        digests = _page_digests(pieces, sizes) if copy.digests else ()
        result = self._perform(src, pull, pull.moved((True,) * len(copy.ops), time.monotonic(), digests=digests))
        with self._lock:
            self.num_inline_pages += result.delivered
        return result

    def release(self, conf: Confirmation, *, wait: bool = True) -> tuple[bool, ...]:
        """Give an unused claim back (idempotent). Returns per page whether the source slot stayed
        live; `wait=False` sends it without waiting for the answer (returns ())."""
        live: list[tuple[bool, ...]] = []
        for action in conf.pull.cancel(wait=wait):
            live.append(self._send_release(conf.source, action))
        return live[0] if live else ()

    def pull(self, endpoint: str, pool: str, page_hexes: Sequence[str], destinations: Sequence[int]) -> PullResult:
        conf = self.confirm(endpoint, pool, page_hexes[:len(destinations)])
        if conf is None:
            return PullResult(0)
        try:
            return self.deliver(conf, destinations)
        finally:
            self.release(conf)

    def _transport_for(self, src: PeerSource) -> str:
        return choose_transport(self.transport, lambda: src.region is not None or src.on_same_host())

    # --- performing actions -----------------------------------------------------------------------

    def _perform(self, src: PeerSource, pull: Pull, actions: list[Action]) -> PullResult | object | None:
        """Carry out the pull's actions in order (a waited-for release feeds its answer back in).
        Returns the pull's result, _AGAIN, or None while the claim is still held."""
        queue = list(actions)
        while queue:
            action = queue.pop(0)
            if isinstance(action, SendRelease):
                live = self._send_release(src, action)
                if pull.state is PullState.RELEASING:
                    queue.extend(pull.release_answered(live))
            elif isinstance(action, Finish):
                return action.result
            elif isinstance(action, ClaimAgain):
                self.forget(src.endpoint)
                return _AGAIN
            elif isinstance(action, BackOff):
                log.info("claim at %s timed out (skipped until %.1f)", src.endpoint, self._went_down(src.endpoint))
                self._await_late_grants(src, action.until)
            elif isinstance(action, Refuse):
                raise PeerError(action.reason)
            elif isinstance(action, ForgetSource):
                self.forget(src.endpoint)
            elif isinstance(action, DigestMismatch):
                self.num_digest_mismatches += 1
                log.warning("page %d from %s does not match its digest: not delivered", action.page, src.endpoint)
            else:
                raise AssertionError(f"the pull asked for {action!r} here")
        return None

    def _send_release(self, src: PeerSource, action: SendRelease) -> tuple[bool, ...]:
        request = m.ReleaseRequest(claim_id=action.claim_id, drop=action.drop, quiet=not action.wait)
        if not action.wait:  # sent by our sender thread: the caller's pull is over once the bytes are in
            src.releases.append(request)
            try:
                self._sender.submit(self._send_releases, src)
            except RuntimeError:  # closed: send it from here
                self._send_releases(src)
            return ()
        try:
            # Short: a source that does not answer ends the claim by lease anyway.
            with src.socket() as client:
                reply = client.request(request, timeout_s=min(RELEASE_TIMEOUT_S, self.timeout_s))
            return tuple(reply.live)
        except (ControlError, OSError, m.ProtocolError) as exc:  # OSError: timed out, or the connection broke
            log.info("release at %s failed (the lease will end it): %s", src.endpoint, exc)
            return ()

    def _send_releases(self, src: PeerSource) -> None:
        """Sender thread: flush one source's queued releases. A socket busy with a long request
        flushes them itself as it ends; we look again shortly, letting other sources go first."""
        if not src.lock.acquire(timeout=SENDER_WAIT_S):
            with contextlib.suppress(RuntimeError):  # shut down: close() or the lease ends them
                self._sender.submit(self._send_releases, src)
            return
        try:
            src.flush_releases()
        finally:
            src.lock.release()

    def _await_late_grants(self, src: PeerSource, until: float) -> None:
        """After a claim timed out: read the source's late answers until the lease it would have
        granted is over (or every answer came), releasing late grants on the socket that owns them."""
        def poll() -> None:
            with src.lock:
                if src.closed:
                    return
                # one bad reply (or a broken same-host connection) must not end the poll
                with contextlib.suppress(zmq.ZMQError, OSError, m.ProtocolError):
                    src.client.drain_late()
                src.flush_releases()
                pending = src.client.num_abandoned
            if not pending:
                return
            if time.monotonic() >= until:  # it never answered: drop its socket and mapping
                self._forget_source(src)
                return
            timer = threading.Timer(LATE_POLL_S, poll)
            timer.daemon = True
            timer.start()
        poll()

    def close(self) -> None:
        self._prober.close()
        self._sender.shutdown(wait=True)  # releases already handed over still go out
        for endpoint in list(self._sources):
            self.forget(endpoint)
        self._copier.close()


def _page_digests(pieces: Sequence[Sequence[int]], sizes: Sequence[int]) -> list[int]:
    """xxh3 of each destination page, over its pieces in order (what the source digested at commit)."""
    out = []
    for page in pieces:
        digest = xxhash.xxh3_64()
        for addr, size in zip(page, sizes):
            digest.update((ctypes.c_char * size).from_address(addr))
        out.append(digest.intdigest())
    return out
