"""Control socket: a ROUTER (and the same-host Unix socket) that decodes requests, hands each to
its handler (control_handlers.py) on the thread its lane calls for, and replies.

It makes no decisions of its own; every refusal comes from the runner or the protocol code
and goes back as an Error naming the problem.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

import zmq

from ..proto import messages as m
from ..proto.claims import ClaimError
from ..proto.control import Lane, lane_for, unauthenticated_refusal
from ..proto.pool import PoolError
from .local_control import LocalConnection, LocalListener, PeerClosed
from .wakeup import Waker

if TYPE_CHECKING:
    from .control_handlers import ControlHandlers
    from .zmq_curve import CurveGate

log = logging.getLogger(__name__)
Reply = Callable[[bytes], None]  # sends one encoded reply to whoever asked



def _owner(ident: bytes) -> str:
    """Claims belong to the connection (its ROUTER identity), not to anything the peer says."""
    return ident.hex()


def _unanswered(payload: bytes) -> None:
    pass




class ControlServer:
    def __init__(self, ctx: zmq.Context, handlers: ControlHandlers, *, endpoint: str, gate: CurveGate | None = None,
                 local_path: str = "", tcp_serves_region: bool | None = None) -> None:
        """`tcp_serves_region`: whether the ZMQ socket answers requests that read, write or address
        the region (default: with CURVE only); when not, only the same-host socket does
        (docs/security.md)."""
        self._gate = gate
        self.tcp_serves_region = gate is not None if tcp_serves_region is None else tcp_serves_region
        self._local_path = local_path
        self.local_path = ""  # where same-host peers connect, once listening ("" when not)
        self._ctx = ctx
        self.handlers = handlers
        self._endpoint = endpoint
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
                for part in self.handlers.snapshot_parts(msg):
                    reply(m.encode(part))
                return
            handler = self.handlers.table.get(type(msg))
            if handler is None:
                raise m.ProtocolError(f"{msg.TYPE} is not a request", code="unknown_type")
            if not trusted:
                refusal = unauthenticated_refusal(msg, self.local_path)
                if refusal:
                    self.num_refused_unauthenticated += 1
                    raise m.ProtocolError(refusal, code="unauthenticated")
                if isinstance(msg, m.InfoRequest):
                    handler = self.handlers.on_public_info
            lane = lane_for(msg, self.handlers.disk_pools)
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
        return m.encode(reply, request_id=request_id, incarnation=self.handlers.incarnation)

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
