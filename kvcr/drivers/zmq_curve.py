"""CURVE on a runner's ZMQ sockets: one authenticator per context for every server socket
(control, events, replay), and the client side every consumer shares.

ZMQ allows one ZAP handler per context, so the runner's servers share this gate instead of each
starting its own. The deployment key is both the servers' and the clients' (docs/security.md).
"""

from __future__ import annotations

import threading
import time

import zmq
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from ..config import CurveKeys
from ..curve_keys import client_keys


def secure_client(sock: zmq.Socket, curve: CurveKeys | None) -> None:
    """Before connect: speak CURVE to a server holding the deployment key, as the deployment or as a
    client with a keypair of its own (nothing without keys)."""
    if curve is not None:
        sock.curve_serverkey = curve.server_key
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret


class CurveGate:
    """Encrypts the server sockets it secures and lets in only clients holding an allowed key."""

    def __init__(self, ctx: zmq.Context, curve: CurveKeys, reread_s: float = 1.0) -> None:
        self._ctx = ctx
        self.curve = curve
        self.num_unauthenticated = 0
        self._auth: ThreadAuthenticator | None = None
        self._lock = threading.Lock()
        self._reread_s = reread_s
        self._clients: frozenset[bytes] = frozenset()
        self._clients_read = -reread_s

    def _callback(self, domain: str, key: bytes) -> bool:
        z85 = zmq.utils.z85.encode(key) if len(key) == 32 else key
        ok = z85 in self.curve.allowed or z85 in self._admitted_clients()
        if not ok:
            self.num_unauthenticated += 1
        return ok

    def _admitted_clients(self) -> frozenset[bytes]:
        """The keys under keys_dir/clients, read again at most once per `reread_s`: a client added
        or removed there is admitted or refused from its next connection on."""
        if self.curve.keys_dir and time.monotonic() - self._clients_read >= self._reread_s:
            self._clients, self._clients_read = client_keys(self.curve.keys_dir), time.monotonic()
        return self._clients

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
