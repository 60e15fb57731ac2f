"""The control socket's requests over a Unix stream socket, for peers on the runner's own host.

A same-host puller's claims and releases skip ZMQ's I/O threads (a thread hand-off at each end,
each way); the handlers and the codec are the control socket's own. A frame is a 4-byte length
and one encoded message. Only the runner's own user (and root) gets in: the socket file is mode
0600, and each connection's peer credentials are checked as it is accepted.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import struct

from ..proto.messages import ProtocolError

log = logging.getLogger(__name__)
FRAME = struct.Struct("<I")
MAX_FRAME = 256 << 20  # far above any reply (a snapshot part is a few MiB): a bad length, not a message
IO_TIMEOUT_S = 2.0     # the serving loop waits this long at most on one peer's half-sent frame
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_path(region_path: str) -> str:
    """Next to the runner's region, named like it: swept with it when its runner died unclean."""
    return region_path + ".sock"


class PeerClosed(ConnectionError):
    """The peer closed its end between frames: the normal end of a connection."""


def _read_exact(sock: socket.socket, n: int) -> bytes:
    """`n` bytes (a socket with a timeout is non-blocking underneath: recv may return fewer)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        size = sock.recv_into(view[got:])
        if not size:
            raise ConnectionError(f"the peer closed the local control socket mid-frame ({got} of {n} bytes)")
        got += size
    return bytes(buf)


def read_frame(sock: socket.socket) -> bytes:
    header = sock.recv(FRAME.size)
    if not header:
        raise PeerClosed("the peer closed the local control socket")
    if len(header) < FRAME.size:
        header += _read_exact(sock, FRAME.size - len(header))
    (size,) = FRAME.unpack(header)
    if size > MAX_FRAME:
        raise ProtocolError(f"a local control frame of {size} bytes is over the {MAX_FRAME}-byte limit")
    return _read_exact(sock, size) if size else b""


def write_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(FRAME.pack(len(payload)) + payload)


class LocalChannel:
    """A client's end: what `ControlClient` sends requests over instead of a ZMQ DEALER."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self._timeout_s = timeout_s
        self._sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self._timeout_s)
        try:
            sock.connect(self.path)
            _, uid, _ = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
        except OSError:
            sock.close()
            raise
        if uid not in (os.getuid(), 0):  # another user's socket could hand us its own bytes as a peer's
            sock.close()
            raise PermissionError(f"{self.path} is served by uid {uid}, not by us ({os.getuid()}) or root")
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        return sock

    def send(self, payload: bytes) -> None:
        write_frame(self._sock, payload)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._poller.poll(timeout_ms))

    def recv(self) -> bytes:
        return read_frame(self._sock)

    def reset(self) -> None:
        """Drop the connection (and any reply still on its way) and open a new one."""
        self._sock.close()
        self._sock = self._connect()

    def close(self, linger_ms: int = 0) -> None:
        self._sock.close()  # what was sent is in the kernel's buffer already: nothing to linger for


class LocalConnection:
    """One accepted peer, as the control loop serves it; claims belong to `owner`."""

    def __init__(self, sock: socket.socket, owner: str) -> None:
        self.sock = sock
        self.owner = owner
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv(self) -> bytes:
        return read_frame(self.sock)

    def reply(self, payload: bytes) -> None:
        """A peer that stopped reading (or left) loses its connection, not the loop's time."""
        if self.closed:
            return
        try:
            write_frame(self.sock, payload)
        except OSError as exc:
            log.info("local control peer %s dropped: %s", self.owner, exc)
            self.close()

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class LocalListener:
    """The listening socket; the control loop polls `fileno()` and calls `accept()` when ready."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._owners = itertools.count(1)
        self._uid = os.getuid()
        self.num_refused = 0
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)  # before listen(): nobody connects while it is still open to all
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> LocalConnection | None:
        """The next peer, or None when none is waiting or its user is not ours (logged)."""
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        pid, uid, _ = _CREDS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
        if uid not in (self._uid, 0):
            log.warning("refused a local control connection from pid %d: uid %d is not ours (%d)", pid, uid, self._uid)
            self.num_refused += 1
            conn.close()
            return None
        conn.setblocking(True)
        conn.settimeout(IO_TIMEOUT_S)
        return LocalConnection(conn, f"local-{next(self._owners)}-{pid}")

    def close(self) -> None:
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
