"""Pulling pages from a peer runner: confirm (claim) over ZMQ, GET over UCX, release.

The destination side of the peer protocol. `confirm` performs the claim and returns exactly how
many leading pages the source promised; `deliver` moves them and releases the claim on every
exit path; what arrives intact is reported page by page (the leading run counts).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import xxhash
import zmq

from .client import ControlClient, ControlError
from .config import CurveKeys
from .drivers.memcopy import Copier
from .drivers.shm import Region, RegionError, host_id
from .drivers.ucx_rma import GetResult
from .proto import messages as m
from .proto.announce import Announce
from .proto.pull import delivered_prefix, plan_segment_gets
from .proto.reach import Reachability

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 0.5
OUTSIDE_REGISTERED = "pages outside the memory the source had registered when we connected"
LEASE_MARGIN = 0.2  # of the lease: slack for clock-rate differences between us and the source
SENDER_WAIT_S = 0.01  # the release sender's wait for one source's socket before it looks at others
RELEASE_LINGER_MS = 200  # a forgotten source's socket still delivers the releases just sent
LATE_POLL_S = 0.2        # how often a timed-out claim's socket is read for the late grant
LATE_GRANT_WAIT_S = 30.0  # how long a late grant is waited for when we asked for no particular lease


class PeerError(RuntimeError):
    """A peer that cannot serve pulls (no UCX, incompatible protocol, refused namespace...)."""


@dataclass
class PeerSource:
    endpoint: str
    client: ControlClient
    incarnation: str
    address: bytes
    region_base: int
    rkeys: dict[int, bytes]
    chunks: list[tuple[int, int]]
    page_bytes: dict[str, int]
    can_move: bool
    shm_path: str = ""
    host_id: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)  # one request at a time on its socket
    region: Region | None = None  # its pool, mapped read-only, for same-host copies
    closed: bool = False          # forgotten: confirmations still holding it must not use it
    releases: list = field(default_factory=list)  # handed to the sender, not sent yet (FIFO)

    @contextlib.contextmanager
    def socket(self) -> Iterator[ControlClient]:
        """Its control client, alone, with queued releases sent first: a request never overtakes
        the release before it, so a claim right after a pull finds the previous one gone. Releases
        queued while we hold it go out as we leave (the sender does not wait for a busy socket)."""
        with self.lock:
            self.flush_releases()
            try:
                yield self.client
            finally:
                self.flush_releases()

    def flush_releases(self) -> None:
        """Send queued releases (call with `lock` held). A failed send is left to the lease."""
        while self.releases and not self.closed:
            with contextlib.suppress(zmq.ZMQError):
                self.client.send(self.releases.pop(0))


@dataclass
class Confirmation:
    """A claim held at a source for the leading `num_pages` of a request's pages."""

    source: PeerSource
    pool: str
    claim_id: int
    offsets: list[int]
    raw_announces: list  # wire form; decoded only by a puller that publishes what it receives
    deadline: float  # monotonic: the lease cannot have ended before this (measured from our request)
    sent: float      # when we sent the claim
    page_bytes: int  # ours, checked against the source's
    digests: list[int] = field(default_factory=list)  # per page, when verify_transfer_bytes
    released: bool = False

    @property
    def num_pages(self) -> int:
        return len(self.offsets)

    def announces(self) -> list[Announce | None]:
        return [Announce.from_wire(a) if a is not None else None for a in self.raw_announces]


@dataclass(frozen=True, slots=True)
class PullResult:
    delivered: int            # leading pages now in the destination buffers, intact
    uncertain: bool = False   # some buffers may still be written: do not reuse them
    error: str = ""


@dataclass
class Puller:
    plane: object                         # UcxPlane
    namespaces: dict[str, dict] = field(default_factory=dict)  # pool -> our namespace fields
    timeout_s: float = 5.0
    abandon_s: float = 5.0
    # Claims and info requests: a source that answers takes milliseconds; one that does not must
    # not hold the engine's prefetch thread for a transfer's deadline.
    control_timeout_s: float = 2.0
    reach: Reachability = field(default_factory=Reachability)
    lease_s: float = 0.0
    trusted: frozenset[str] | None = None  # endpoints we may pull from; None: any
    curve: CurveKeys | None = None
    verify_transfer_bytes: bool = False  # per-page digest from the source, checked after the GETs
    page_bytes: dict[str, int] = field(default_factory=dict)  # our page size per pool: a source must match
    # "get": one-sided UCX RMA; "tag": the source sends into receives we posted; "shm": copy from the
    # source's pool mapped read-only (same host only); "auto": "shm" on the same host, else "get".
    transport: str = "get"
    copy_threads: int = 0  # same-host copies: threads a large pull is split over (0: one per core, up to 4)
    num_digest_mismatches: int = 0
    _sources: dict[str, PeerSource] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    num_refused_untrusted: int = 0
    _copier: Copier = field(init=False)
    _sender: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self._copier = Copier(self.copy_threads)  # threads start on first use
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="kvcr-release")

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
        client = ControlClient(endpoint, timeout_s=self.control_timeout_s, curve=self.curve)
        try:
            src = self._describe(endpoint, client, client.info())
        except BaseException:
            client.close()
            raise
        client.on_late_reply = functools.partial(self._late_reply, src)
        return src

    @staticmethod
    def _late_reply(src: PeerSource, reply: m.Message) -> None:
        """A claim granted after we stopped waiting (the source was stalled): nobody will read
        those pages, so it goes back now rather than at its lease end."""
        if isinstance(reply, m.Granted) and reply.offsets:
            src.releases.append(m.ReleaseRequest(claim_id=reply.claim_id))

    def _await_late_grants(self, src: PeerSource, until: float) -> None:
        """After a claim timed out: read the source's late answers until the lease it would have
        granted is over (or every answer came), releasing late grants on the socket that owns them."""
        def poll() -> None:
            with src.lock:
                if src.closed:
                    return
                with contextlib.suppress(zmq.ZMQError):
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

    def _forget_source(self, src: PeerSource) -> None:
        """forget(), unless the endpoint is already known by a newer connection."""
        with self._lock:
            current = self._sources.get(src.endpoint) is src
        if current:
            self.forget(src.endpoint)

    def _describe(self, endpoint: str, client: ControlClient, info: dict) -> PeerSource:
        if info["protocol"][0] != m.PROTOCOL_MAJOR:
            raise PeerError(f"{endpoint} speaks protocol {info['protocol']}, we speak "
                            f"{[m.PROTOCOL_MAJOR, m.PROTOCOL_MINOR]}")
        ucx = info.get("ucx")
        if not ucx or "ucx_get" not in info.get("capabilities", []):
            raise PeerError(f"{endpoint} does not serve UCX pulls")
        return PeerSource(endpoint, client, info["incarnation"], bytes.fromhex(ucx["address"]), ucx["region_base"],
                          {off: bytes.fromhex(k) for off, _, k in ucx["rkeys"]},
                          [(off, length) for off, length, _ in ucx["rkeys"]],
                          {p["name"]: p["page_bytes"] for p in info["pools"]}, "move" in info["capabilities"],
                          info.get("shm_path", ""), info.get("host_id", ""))

    def forget(self, endpoint: str) -> None:
        with self._lock:
            src = self._sources.pop(endpoint, None)
        if src is not None:
            with src.lock:  # not while another thread uses the socket or copies from the mapping
                src.flush_releases()  # queued releases still go out: else the claims wait for their lease
                src.closed = True
                src.client.close(linger_ms=RELEASE_LINGER_MS)
                if src.region is not None:
                    src.region.close()
                    src.region = None

    def lookup(self, endpoint: str, pool: str, page_hexes: Sequence[str]) -> list[int]:
        src = self.source(endpoint)
        with src.socket() as client:
            return client.request(m.Lookup(pool=pool, keys=list(page_hexes))).tiers

    def confirm(self, endpoint: str, pool: str, page_hexes: Sequence[str], *, _retry: bool = True
                ) -> Confirmation | None:
        """Claim the leading pages at the source. None when it has none, is busy or cannot be
        reached (a miss); PeerError when it must not be used (untrusted, another namespace)."""
        if not self.reach.allow(endpoint, time.monotonic()):
            return None  # it did not answer lately: a miss now, not another wait
        try:
            src = self.source(endpoint)
        except (TimeoutError, OSError, ControlError) as exc:
            log.info("peer %s unreachable (skipped until %.1f): %s", endpoint,
                     self.reach.failed(endpoint, time.monotonic()), exc)
            return None
        sent = time.monotonic()
        try:
            with src.socket() as client:
                reply = client.request(m.ClaimRequest(pool=pool, keys=list(page_hexes), lease_s=self.lease_s,
                                                      namespace=self.namespaces.get(pool, {}),
                                                      digests=self.verify_transfer_bytes))
        except ControlError as exc:
            self.reach.answered(endpoint)
            if exc.code == "namespace":
                raise PeerError(str(exc)) from None
            log.info("claim at %s refused: %s", endpoint, exc)
            return None
        except TimeoutError:
            # Stalled or gone: skipped for a while; a grant it sends late is given straight back.
            self.reach.failed(endpoint, time.monotonic())
            self._await_late_grants(src, time.monotonic() + (self.lease_s or LATE_GRANT_WAIT_S))
            return None
        self.reach.answered(endpoint)
        if reply.incarnation != src.incarnation:
            # The source restarted: what we know of its region and keys is stale. Give the claim
            # back, learn the new incarnation, and ask once more.
            if reply.offsets:
                with src.socket() as client, contextlib.suppress(ControlError, TimeoutError):  # else its lease
                    client.request(m.ReleaseRequest(claim_id=reply.claim_id), timeout_s=RELEASE_TIMEOUT_S)
            self.forget(endpoint)
            return self.confirm(endpoint, pool, page_hexes, _retry=False) if _retry else None
        if not reply.offsets:
            return None
        problem = self._check_grant(reply, len(page_hexes), pool, src)
        if problem:  # a source that answers nonsense gets nothing from us but its claim back
            log.warning("claim reply from %s refused: %s", endpoint, problem)
            with src.socket() as client, contextlib.suppress(ControlError, TimeoutError):
                client.request(m.ReleaseRequest(claim_id=reply.claim_id), timeout_s=RELEASE_TIMEOUT_S)
            if problem == OUTSIDE_REGISTERED and _retry:  # it registered more since we asked: look again
                self.forget(endpoint)
                return self.confirm(endpoint, pool, page_hexes, _retry=False)
            return None
        if self._copies(src):
            with src.lock:
                if not src.closed:
                    self._map_same_host(src)  # a failure shows at the copy
        return Confirmation(src, pool, reply.claim_id, reply.offsets, reply.announces, sent + reply.lease_s, sent,
                            src.page_bytes[pool], reply.digests)

    def _check_grant(self, reply: m.Granted, asked: int, pool: str, src: PeerSource) -> str:
        ours = self.page_bytes.get(pool)
        if ours is not None and src.page_bytes.get(pool) != ours:
            return f"pool {pool!r} pages are {src.page_bytes.get(pool)} bytes there, {ours} here"
        if len(reply.offsets) > asked or not all(type(o) is int and o >= 0 for o in reply.offsets):
            return "offsets are not one non-negative integer per page asked for"
        if self.verify_transfer_bytes and (len(reply.digests) != len(reply.offsets)
                                           or not all(type(d) is int for d in reply.digests)):
            return "digests were asked for but not given for every page"
        if not 0 < reply.lease_s <= 3600:
            return f"lease {reply.lease_s!r} is not a duration"
        size = src.page_bytes[pool]
        if not all(any(start <= o and o + size <= start + length for start, length in src.chunks)
                   for o in reply.offsets):
            return OUTSIDE_REGISTERED
        return ""

    def release(self, conf: Confirmation, *, drop: int = 0, wait: bool = True) -> tuple[bool, ...]:
        """End the claim (idempotent). Returns per page whether the source slot stayed live.
        `drop` (move mode): the source drops its copies of this many leading pages (those still live).
        `wait=False` sends the release without waiting for its answer (returns ())."""
        if conf.released:
            return ()
        conf.released = True
        if not wait:  # sent by our sender thread: the caller's pull is over once the bytes are in
            conf.source.releases.append(m.ReleaseRequest(claim_id=conf.claim_id, drop=drop))
            try:
                self._sender.submit(self._send_releases, conf.source)
            except RuntimeError:  # closed: send it from here
                self._send_releases(conf.source)
            return ()
        try:
            # Short: a source that does not answer ends the claim by lease anyway.
            with conf.source.socket() as client:
                reply = client.request(m.ReleaseRequest(claim_id=conf.claim_id, drop=drop),
                                       timeout_s=min(RELEASE_TIMEOUT_S, self.timeout_s))
            return tuple(reply.live)
        except (ControlError, TimeoutError) as exc:
            log.info("release at %s failed (the lease will end it): %s", conf.source.endpoint, exc)
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

    def deliver(self, conf: Confirmation, destinations: Sequence[int] | Sequence[Sequence[int]], *,
                segments: Sequence[int] | None = None, slice_offset: int = 0, move: bool = False) -> PullResult:
        """GET the confirmed pages into `destinations`, then release the claim. A destination is a
        page's address, or with `segments` (the byte sizes of a page's pieces, in order) the
        addresses of its pieces: an engine's host page need not be contiguous. With `slice_offset`
        the pieces cover only the bytes from there (one TP rank's shard of a sidecar's page).

        With `move` (only towards sources that advertise it) the release asks the source to drop
        its copies of the pages we verifiably received, and only those."""
        src = conf.source
        n = min(conf.num_pages, len(destinations))
        pieces = [(d,) for d in destinations[:n]] if segments is None else destinations[:n]
        sizes = (conf.page_bytes,) if segments is None else tuple(segments)
        whole = slice_offset == 0 and sum(sizes) == conf.page_bytes
        if (slice_offset < 0 or slice_offset + sum(sizes) > conf.page_bytes or (not whole and conf.digests)
                or (not whole and move)):
            self.release(conf)
            raise PeerError(f"pieces of {sum(sizes)} bytes from byte {slice_offset} do not fit a page of "
                            f"{conf.page_bytes} (or a slice was asked with digests or move)")
        ops = plan_segment_gets(pieces, [o + slice_offset for o in conf.offsets[:n]], sizes, chunks=src.chunks)
        try:
            result = self._transfer(conf, ops)
        except Exception as exc:  # nothing proves the transfer stopped: the buffers are uncertain
            self.release(conf)
            log.warning("pull from %s failed: %s", src.endpoint, exc)
            return PullResult(0, True, f"{type(exc).__name__}: {exc}")
        finished = time.monotonic()
        arrived = delivered_prefix(ops, result.done, (True,) * n, n)
        if conf.digests:
            arrived = self._verified_prefix(conf, pieces, sizes, arrived)
        # The source cannot reuse a claimed slot before the lease ends, and our deadline was taken
        # before the source started the lease. GETs that finished well inside it read the claimed
        # bytes, so the release need not be waited for; a late finish asks the source (generations).
        in_lease = finished < conf.deadline - LEASE_MARGIN * (conf.deadline - conf.sent)
        drop = arrived if move and src.can_move and not result.uncertain else 0
        live = self.release(conf, drop=drop, wait=bool(drop) or not in_lease)  # a move changes the source
        if not live and in_lease:
            # No release answer (not asked, or the source died), but every GET ended inside the
            # lease: the source could not have reused those slots, so what arrived is what was claimed.
            live = (True,) * n
        delivered = min(arrived, delivered_prefix(ops, result.done, live, n))
        if result.error:
            self.forget(src.endpoint)
        return PullResult(delivered, result.uncertain, result.error)

    def _transfer(self, conf: Confirmation, ops: list) -> GetResult:
        src = conf.source
        if self._copies(src):
            return self._copy_same_host(src, ops)
        if self.transport in ("get", "auto"):
            return self.plane.get(src.address, src.rkeys, src.region_base,
                                  [(op.local, op.nbytes, op.remote_offset) for op in ops],
                                  timeout_s=self.timeout_s, abandon_s=self.abandon_s)
        base = random.getrandbits(40) << 20  # tags unique to this transfer
        tagged = [(op.local, op.nbytes, base + i) for i, op in enumerate(ops)]
        with src.socket() as client:
            request_id = client.send(m.SendPages(claim_id=conf.claim_id, address=self.plane.pull_address.hex(),
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

            return self.plane.receive_tagged(tagged, source_answer, timeout_s=self.timeout_s,
                                             abandon_s=self.abandon_s)

    @staticmethod
    def _same_host(src: PeerSource) -> bool:
        return bool(src.host_id) and src.host_id == host_id() and os.access(src.shm_path, os.R_OK)

    def _copies(self, src: PeerSource) -> bool:
        """Same-host copy rather than UCX: asked for, or "auto" with the source's pool mapped or mappable."""
        return self.transport == "shm" or (self.transport == "auto" and (src.region is not None or self._same_host(src)))

    def _map_same_host(self, src: PeerSource) -> str:
        """Map the source's pool read-only (call with `src.lock` held); returns the problem, if any.
        Mapped at the grant, a source that dies after granting still holds, in our mapping, exactly
        the pages it claimed for us (its file may be unlinked by then)."""
        if src.region is not None:
            return ""
        if not self._same_host(src):
            return "the source is gone or not on this host"
        try:
            src.region = Region.attach(src.shm_path, writable=False)
        except (OSError, RegionError) as exc:
            return f"cannot map the source's pool: {exc}"
        return ""

    def _copy_same_host(self, src: PeerSource, ops: list) -> GetResult:
        """Same host: copy straight from the source's pool, mapped read-only. A memcpy ends before
        we return, so nothing is ever left in flight (no cancel, no uncertainty)."""
        with src.lock:
            problem = "the source is forgotten" if src.closed else self._map_same_host(src)
            if problem:
                return GetResult((False,) * len(ops), error=problem)
            base, size = src.region.address, src.region.size
            done = [0 <= op.remote_offset and op.remote_offset + op.nbytes <= size for op in ops]
            self._copier.copy([(op.local, op.nbytes, base + op.remote_offset) for op, ok in zip(ops, done) if ok])
        return GetResult(tuple(done), error="" if all(done) else "a page lies outside the source's pool")

    def _verified_prefix(self, conf: Confirmation, pieces: Sequence[Sequence[int]], sizes: Sequence[int],
                         n: int) -> int:
        """Cut the delivered run at the first page whose bytes differ from the source's digest."""
        for i in range(n):
            digest = xxhash.xxh3_64()
            for addr, size in zip(pieces[i], sizes):
                digest.update((ctypes.c_char * size).from_address(addr))
            if digest.intdigest() != conf.digests[i]:
                self.num_digest_mismatches += 1
                log.warning("page %d from %s does not match its digest: not delivered", i, conf.source.endpoint)
                return i
        return n

    def pull(self, endpoint: str, pool: str, page_hexes: Sequence[str], destinations: Sequence[int]) -> PullResult:
        conf = self.confirm(endpoint, pool, page_hexes[:len(destinations)])
        if conf is None:
            return PullResult(0)
        try:
            return self.deliver(conf, destinations)
        finally:
            self.release(conf)

    def close(self) -> None:
        self._sender.shutdown(wait=True)  # releases already handed over still go out
        for endpoint in list(self._sources):
            self.forget(endpoint)
        self._copier.close()
