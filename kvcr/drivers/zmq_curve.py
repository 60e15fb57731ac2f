"""CURVE on a runner's ZMQ sockets: one authenticator per context for every server socket
(control, events, replay), and the client side every consumer shares.

ZMQ allows one ZAP handler per context, so the runner's servers share this gate instead of each
starting its own. The deployment key is both the servers' and the clients' (docs/security.md).
"""

from __future__ import annotations

import threading

import zmq
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from ..config import CurveKeys


def secure_client(sock: zmq.Socket, curve: CurveKeys | None) -> None:
    """Before connect: speak CURVE to a server holding the deployment key (nothing without keys)."""
    if curve is not None:
        sock.curve_serverkey = curve.public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret


class CurveGate:
    """Encrypts the server sockets it secures and lets in only clients holding an allowed key."""

    def __init__(self, ctx: zmq.Context, curve: CurveKeys) -> None:
        self._ctx = ctx
        self.curve = curve
        self.num_unauthenticated = 0
        self._auth: ThreadAuthenticator | None = None
        self._lock = threading.Lock()

    def _callback(self, domain: str, key: bytes) -> bool:
        ok = (zmq.utils.z85.encode(key) if len(key) == 32 else key) in self.curve.allowed
        if not ok:
            self.num_unauthenticated += 1
        return ok

    def secure(self, sock: zmq.Socket) -> None:
        """Before bind. Starts the authenticator on first use."""
        with self._lock:
            if self._auth is None:
                gate = self

                class Allowed:
                    def callback(self, domain: str, key: bytes) -> bool:  # zmq's provider API
                        return gate._callback(domain, key)

                self._auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve_callback("*", credentials_provider=Allowed())
        sock.curve_secretkey = self.curve.secret
        sock.curve_publickey = self.curve.public
        sock.curve_server = True

    def stop(self) -> None:
        with self._lock:
            if self._auth is not None:
                self._auth.stop()
                self._auth = None
