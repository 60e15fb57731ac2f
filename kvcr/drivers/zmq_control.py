"""Control socket: a ROUTER that decodes requests, asks the runner, and replies.

It makes no decisions of its own; every refusal comes from the runner or the protocol code
and goes back as an Error naming the problem.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterator

import zmq

from ..proto import messages as m
from ..proto.announce import Announce
from ..proto.claims import MAX_LEASE_S, ClaimError
from ..proto.hints import parse_envelope
from ..proto.control import Lane, lane_for, unauthenticated_refusal
from ..proto.keys import StorageKey
from ..proto.pool import Page, PoolError
from ..proto.pull import NoPuller, PeerError
from .local_control import LocalConnection, LocalListener, PeerClosed
from .wakeup import Waker

if TYPE_CHECKING:
    from ..peer_pulls import PeerPulls
    from .zmq_curve import CurveGate
    from ..runner.dram import Runner
    from ..runner.lower import LowerTier
    from ..runner.shards import ShardAssembly
    from .ucx_plane import UcxPlane

log = logging.getLogger(__name__)
Reply = Callable[[bytes], None]  # sends one encoded reply to whoever asked
SNAPSHOT_CHUNK = 4096

MAX_PID = 1 << 22  # Linux pid_max ceiling
OFFSET_PRESENT = -1    # Reserved.offsets: the page is stored already
OFFSET_IN_FLIGHT = -2  # Reserved.offsets: another writer is storing it (it may still fail)


def _owner(ident: bytes) -> str:
    """Claims belong to the connection (its ROUTER identity), not to anything the peer says."""
    return ident.hex()


def _unanswered(payload: bytes) -> None:
    pass


def _check_lease(lease_s: float) -> None:
    """0 means the runner's default; anything else must be a sane, finite duration."""
    if not (lease_s == 0 or 0 < lease_s <= MAX_LEASE_S):
        raise m.ProtocolError(f"lease_s {lease_s!r} must be 0 (default) or in (0, {MAX_LEASE_S}]")


class ControlServer:
    def __init__(self, ctx: zmq.Context, runner: Runner, pulls: PeerPulls, plane: UcxPlane | None, *,
                 lower: LowerTier, shards: ShardAssembly, endpoint: str,
                 info: Callable[[], dict], snapshot: Callable[[], tuple[int, list]],
                 gate: CurveGate | None = None, local_path: str = "", public_info: Callable[[], dict] | None = None,
                 tcp_serves_region: bool | None = None) -> None:
        """`public_info`: info without what addresses the region. `tcp_serves_region`: whether the
        ZMQ socket answers requests that read, write or address the region (default: with CURVE
        only); when not, only the same-host socket does (docs/security.md)."""
        self._gate = gate
        self._public_info = public_info or info
        self.tcp_serves_region = gate is not None if tcp_serves_region is None else tcp_serves_region
        self._local_path = local_path
        self.local_path = ""  # where same-host peers connect, once listening ("" when not)
        self._ctx = ctx
        self.runner = runner
        self.lower = lower
        self.shards = shards
        self.pulls = pulls
        self.plane = plane
        self._endpoint = endpoint
        self._info = info
        self._snapshot = snapshot
        self.bound_endpoint = ""
        self.num_requests = 0
        self.num_rejected = 0
        self.num_local_requests = 0  # of num_requests, over the same-host socket
        self.num_refused_unauthenticated = 0  # region requests refused over an unauthenticated socket
        self._listener: LocalListener | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvcr-control", daemon=True)
        # Requests that wait on other peers or the disk run here, so this socket keeps answering
        # (two runners pulling from each other must not wait on each other's control thread).
        self._slow = ThreadPoolExecutor(4, thread_name_prefix="kvcr-control-slow")
        # Serving a peer never waits behind our own pulls (two runners pulling from each other).
        self._serving = ThreadPoolExecutor(4, thread_name_prefix="kvcr-control-serve")
        self._done: queue.SimpleQueue[tuple[Reply, bytes]] = queue.SimpleQueue()
        self._wake = Waker()  # a deferred reply goes out at once, not at the poll's next timeout
        self._handlers = {m.InfoRequest: self._on_info, m.Lookup: self._on_lookup, m.Reserve: self._on_reserve,
                          m.Commit: self._on_commit, m.ClaimRequest: self._on_claim, m.Renew: self._on_renew,
                          m.ReleaseRequest: self._on_release, m.Remove: self._on_remove,
                          m.Persist: self._on_persist, m.PullRequest: self._on_pull, m.PostHint: self._on_post_hint,
                          m.SendPages: self._on_send_pages, m.ReserveShard: self._on_reserve_shard,
                          m.CommitShard: self._on_commit_shard}

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"control socket failed to start: {self._error}")

    @property
    def num_local_refused(self) -> int:
        return self._listener.num_refused if self._listener is not None else 0

    def health(self) -> str:
        if self._error is not None:
            return f"control socket failed: {self._error!r}"
        return "" if self._thread.is_alive() or self._stop.is_set() else "control thread is gone"

    def stop(self, timeout: float = 5.0) -> None:
        self._slow.shutdown(wait=True, cancel_futures=True)
        self._serving.shutdown(wait=True, cancel_futures=True)
        self._stop.set()
        self._wake.wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._wake.close()

    def _run(self) -> None:
        try:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            if self._gate is not None:  # encrypted, and only clients holding an allowed key get in
                self._gate.secure(sock)
            sock.bind(self._endpoint)
            self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        listener = self._listen_locally()
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        local: dict[int, LocalConnection] = {}
        if listener is not None:
            poller.register(listener.fileno(), zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(1000))
                if sock in ready:
                    self._serve_one(sock)
                if self._wake.fd in ready:  # cleared only when set: no syscall per plain request
                    self._wake.clear()
                for fd in ready.keys() & local.keys():
                    if not self._serve_local(local[fd]):
                        poller.unregister(fd)
                        local.pop(fd).close()
                if listener is not None and listener.fileno() in ready:
                    self._accept(listener, poller, local)
                while not self._done.empty():
                    reply, payload = self._done.get()
                    reply(payload)
        except BaseException as exc:  # reported by health()
            self._error = exc
            log.exception("control socket stopped")
        finally:
            sock.close()
            for conn in local.values():
                conn.close()
            if listener is not None:
                listener.close()

    def _listen_locally(self) -> LocalListener | None:
        """The same-host socket is a shortcut: without it, peers on this host use the control socket."""
        if not self._local_path:
            return None
        try:
            listener = LocalListener(self._local_path)
        except OSError as exc:
            log.warning("no same-host control socket at %s (peers here use %s): %s", self._local_path,
                        self.bound_endpoint, exc)
            return None
        self.local_path = listener.path
        self._listener = listener
        return listener

    @staticmethod
    def _accept(listener: LocalListener, poller: zmq.Poller, local: dict[int, LocalConnection]) -> None:
        conn = listener.accept()
        if conn is not None:
            local[conn.fileno()] = conn
            poller.register(conn.fileno(), zmq.POLLIN)

    def _serve_local(self, conn: LocalConnection) -> bool:
        """One frame from a same-host peer; False once the connection is over (closed, broken,
        stalled mid-frame, or a frame length no message has)."""
        try:
            payload = conn.recv()
        except PeerClosed:
            return False
        except (OSError, m.ProtocolError) as exc:
            log.info("local control peer %s dropped: %s", conn.owner, exc)
            return False
        self.num_local_requests += 1
        self._serve(payload, conn.owner, conn.reply, trusted=True)
        return not conn.closed

    def _serve_one(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        ident = frames[0]
        route = [ident] if len(frames) == 2 else [ident, b""]  # a REQ-style client gets its delimiter back

        def reply(payload: bytes) -> None:
            sock.send_multipart([*route, payload])
        if len(frames) not in (2, 3) or (len(frames) == 3 and frames[1] != b""):
            self.num_requests += 1
            reply(self._encoded(0, self._error_reply(
                m.ProtocolError(f"expected [payload] or [empty, payload] frames, got {len(frames) - 1}"))))
            return
        self._serve(frames[-1], _owner(ident), reply, trusted=self.tcp_serves_region)

    def _serve(self, payload: bytes, owner: str, reply: Reply, *, trusted: bool) -> None:
        """Decode, answer now or on a worker thread (`reply` then runs on this loop's thread).
        `trusted`: the peer may read, write and address the region (CURVE, or our own user)."""
        self.num_requests += 1
        request_id = 0
        try:
            msg = m.decode(payload)
            request_id = msg.request_id
            if not msg.wants_reply:  # answered with nothing, refusals included (still counted)
                reply = _unanswered
            if isinstance(msg, m.SnapshotRequest):
                for part in self._snapshot_parts(msg):
                    reply(m.encode(part))
                return
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise m.ProtocolError(f"{msg.TYPE} is not a request", code="unknown_type")
            if not trusted:
                refusal = unauthenticated_refusal(msg, self.local_path)
                if refusal:
                    self.num_refused_unauthenticated += 1
                    raise m.ProtocolError(refusal, code="unauthenticated")
                if isinstance(msg, m.InfoRequest):
                    handler = self._on_public_info
            lane = lane_for(msg, self.lower.pools)
            if lane is not Lane.INLINE:
                pool = self._slow if lane is Lane.SLOW else self._serving
                pool.submit(self._answer_later, reply, owner, request_id, handler, msg)
                return
            answer = handler(msg, owner)
        except Exception as exc:
            answer = self._error_reply(exc)
        reply(self._encoded(request_id, answer))

    def _answer_later(self, reply: Reply, owner: str, request_id: int, handler, msg: m.Message) -> None:
        try:
            answer = handler(msg, owner)
        except Exception as exc:
            answer = self._error_reply(exc)
        self._done.put((reply, self._encoded(request_id, answer)))
        self._wake.wake()

    def _encoded(self, request_id: int, reply: m.Message) -> bytes:
        if isinstance(reply, m.Error):
            self.num_rejected += 1
        return m.encode(reply, request_id=request_id, incarnation=self.runner.incarnation)

    @staticmethod
    def _error_reply(exc: Exception) -> m.Error:
        """Every refusal names its problem; an unexpected exception costs one request, not the thread."""
        if isinstance(exc, m.ProtocolError):
            return m.Error(code=exc.code, message=str(exc))
        if isinstance(exc, ClaimError):
            return m.Error(code="claim", message=str(exc))
        if isinstance(exc, (PoolError, ValueError)):
            return m.Error(code=type(exc).__name__, message=str(exc))
        log.error("control request failed", exc_info=exc)
        return m.Error(code="internal", message=f"{type(exc).__name__}: {exc}")

    def _snapshot_parts(self, msg: m.SnapshotRequest) -> Iterator[m.SnapshotPart]:
        seq, events = self._snapshot()
        wire = [e.to_wire() for e in events]
        chunks = [wire[i:i + SNAPSHOT_CHUNK] for i in range(0, len(wire), SNAPSHOT_CHUNK)] or [[]]
        for i, chunk in enumerate(chunks):
            yield m.SnapshotPart(request_id=msg.request_id, incarnation=self.runner.incarnation, seq=seq,
                                 events=chunk, done=i == len(chunks) - 1)

    # --- handlers: decoded message in, reply out ---------------------------------------------------

    def _on_info(self, msg: m.InfoRequest, owner: str) -> m.Message:
        return m.Info(info=self._info())

    def _on_public_info(self, msg: m.InfoRequest, owner: str) -> m.Message:
        return m.Info(info=self._public_info())

    def _on_lookup(self, msg: m.Lookup, owner: str) -> m.Message:
        keys = self._keys(msg.pool, msg.keys)
        return m.LookupReply(num_ready=self.runner.lookup(msg.pool, keys), tiers=self.runner.tiers(msg.pool, keys))

    def _on_remove(self, msg: m.Remove, owner: str) -> m.Message:
        if msg.everything:
            return m.Removed(num_removed=self.runner.clear(msg.pool))
        return m.Removed(num_removed=self.runner.remove(msg.pool, self._keys(msg.pool, msg.keys)))

    def _on_pull(self, msg: m.PullRequest, owner: str) -> m.Message:
        try:
            num_local = self.pulls.pull_requested(msg.pool, [k.page_hex for k in self._keys(msg.pool, msg.keys)],
                                                  source=msg.source_endpoint, event_hashes=msg.event_hashes)
        except NoPuller as exc:
            raise m.ProtocolError(str(exc), code="no_ucx") from None
        except PeerError as exc:
            raise m.ProtocolError(str(exc), code="peer") from None
        return m.Pulled(num_local=num_local)

    def _on_persist(self, msg: m.Persist, owner: str) -> m.Message:
        if msg.pool not in self.lower.pools:
            raise m.ProtocolError("this runner has no NVMe tier (nvme.storage_dir is not set)", code="no_nvme")
        return m.Persisted(num_persisted=self.lower.persist(msg.pool, self._keys(msg.pool, msg.keys)))

    def _on_reserve(self, msg: m.Reserve, owner: str) -> m.Message:
        _check_lease(msg.lease_s)
        if not 0 <= msg.writer_pid <= MAX_PID:
            raise m.ProtocolError(f"reserve.writer_pid {msg.writer_pid} is not a process id")
        announces = [Announce.from_wire(a) if a is not None else None for a in msg.announces] or None
        if announces is not None and len(announces) != len(msg.keys):
            raise m.ProtocolError(f"reserve has {len(msg.keys)} keys but {len(announces)} announces")
        fill = self.runner.reserve(msg.pool, self._keys(msg.pool, msg.keys), announces, owner=owner,
                                   lease_s=msg.lease_s or None, writer_pid=msg.writer_pid)
        return m.Reserved(fill_id=fill.fill_id, offsets=self._offsets(msg.pool, fill.pages))

    def _on_reserve_shard(self, msg: m.ReserveShard, owner: str) -> m.Message:
        _check_lease(msg.lease_s)
        announces = [Announce.from_wire(a) if a is not None else None for a in msg.announces] or None
        if announces is not None and len(announces) != len(msg.keys):
            raise m.ProtocolError(f"reserve_shard has {len(msg.keys)} keys but {len(announces)} announces")
        fill, shard_offset = self.shards.reserve(msg.pool, self._keys(msg.pool, msg.keys), msg.shard, announces,
                                                 lease_s=msg.lease_s or None)
        return m.ShardReserved(fill_id=fill.fill_id, offsets=self._offsets(msg.pool, fill.pages),
                               shard_offset=shard_offset)

    def _on_commit_shard(self, msg: m.CommitShard, owner: str) -> m.Message:
        verdict = self.shards.commit(msg.fill_id, msg.shard, bool(msg.ok))
        return m.ShardCommitted(verdict="waiting" if verdict is None else "committed" if verdict else "discarded")

    def _offsets(self, pool: str, pages: list) -> list[int]:
        return [self.runner.offset(pool, p.slot) if isinstance(p, Page) else
                OFFSET_PRESENT if p is None else OFFSET_IN_FLIGHT for p in pages]

    def _on_commit(self, msg: m.Commit, owner: str) -> m.Message:
        return m.Committed(num_committed=self.runner.commit(msg.fill_id, msg.ok or None, owner=owner))

    def _on_claim(self, msg: m.ClaimRequest, owner: str) -> m.Message:
        _check_lease(msg.lease_s)
        self._check_namespace(msg.pool, msg.namespace)
        registered = self.plane.registered if self.plane is not None else None
        grant = self.runner.grant(msg.pool, self._keys(msg.pool, msg.keys), owner=owner, lease_s=msg.lease_s or None,
                                  digests=msg.digests, registered=registered)
        return grant.reply

    def _check_namespace(self, pool: str, theirs: dict) -> None:
        """Same page hash, other namespace = other bytes: refuse, naming both values."""
        if not theirs:
            return
        mine = self.runner.layouts[self.runner.pool(pool).name].namespace.fields()
        diff = [f"{k}: ours {mine[k]!r}, yours {theirs.get(k)!r}" for k in mine if theirs.get(k) != mine[k]]
        if diff:
            raise m.ProtocolError(f"namespace mismatch on pool {pool!r}: " + "; ".join(diff), code="namespace")

    def _on_renew(self, msg: m.Renew, owner: str) -> m.Message:
        return self.runner.renew(msg.claim_id, owner=owner)

    def _on_release(self, msg: m.ReleaseRequest, owner: str) -> m.Message:
        return self.runner.release(msg.claim_id, owner=owner, drop=msg.drop).reply

    def _on_send_pages(self, msg: m.SendPages, owner: str) -> m.Message:
        """Two-sided fallback: send claimed pages, and nothing else, to the puller's worker."""
        plane = self.plane
        if plane is None:
            raise m.ProtocolError("this runner has no UCX data plane (runner.ucx = false)", code="no_ucx")
        try:
            address = bytes.fromhex(msg.address)
        except ValueError:
            raise m.ProtocolError("send_pages.address is not a hex UCX worker address") from None
        # Our own pin on the claim's pages: its lease may end while the sends run, the pin may not.
        pinned = self.runner.pin_claimed(msg.claim_id, owner, [(o, n) for o, n, _ in msg.ops])
        if pinned is None:
            raise m.ProtocolError(f"send_pages asks for bytes outside claim {msg.claim_id}", code="claim")
        base = self.runner.region_address
        done = plane.send_tagged(address, [(base + o, n, tag) for o, n, tag in msg.ops],
                                 timeout_s=self.runner.cfg.runner.pull_timeout_s)
        if all(done):  # a send still running may read these slots: then they stay pinned for good
            self.runner.unpin(*pinned)
        return m.Sent(done=done)

    def _on_post_hint(self, msg: m.PostHint, owner: str) -> m.Message:
        hint = parse_envelope(msg.envelope, allow_move=True)  # HintError names the problem
        self.pulls.post_hint(hint)
        return m.HintPosted(num_hashes=len(hint.block_hashes))

    def _keys(self, pool: str, page_hexes: list[str]) -> list[StorageKey]:
        self.runner.pool(pool)
        return self.runner.keys(pool, page_hexes)
