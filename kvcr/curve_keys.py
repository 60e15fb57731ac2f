"""A deployment's key directory: what `kvcr keys init DIR` writes and runners, the router and the
CLI read (`runner.keys_dir`, KVCR_KEYS_DIR). Layout (docs/security.md):

    DIR/curve.public   the deployment's CURVE public key (Z85, 40 characters), mode 0644
    DIR/curve.secret   its secret key, mode 0600
    DIR/http.token     the token /info and the router's operator routes ask for, mode 0600
    DIR/clients/NAME.public   a client's own public key: runners admit it (`kvcr keys client`)

A client's directory (`kvcr keys client DIR NAME OUT`) holds the client's own keypair in
curve.public / curve.secret, the deployment's public key in server.public, and http.token.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import zmq

FILES = {"curve.public": 0o644, "curve.secret": 0o600, "http.token": 0o600, "server.public": 0o644}
DEPLOYMENT_FILES = ("curve.public", "curve.secret", "http.token")


class KeysError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class DeploymentKeys:
    curve_public: str
    curve_secret: str
    http_token: str
    server_public: str = ""  # a client's directory: the deployment key it talks to ("" in the deployment's)


def init(directory: str | Path) -> list[str]:
    """Create what is missing (a keypair only ever as a pair); returns the files written."""
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    made = []
    if not (d / "curve.public").exists() or not (d / "curve.secret").exists():
        public, secret = zmq.curve_keypair()
        made += [_write(d, "curve.public", public.decode()), _write(d, "curve.secret", secret.decode())]
    if not (d / "http.token").exists():
        made.append(_write(d, "http.token", secrets.token_urlsafe(32)))
    return made


def add_client(directory: str | Path, name: str, out: str | Path) -> Path:
    """A keypair of the client's own in `out` (with the deployment's public key and token), its
    public key admitted in `directory/clients/NAME.public`. Revoke by removing that file."""
    if not CLIENT_NAME.fullmatch(name):
        raise KeysError(f"client name {name!r} must be letters, digits, '.', '_' or '-'")
    deployment = load(directory)
    if deployment.server_public:
        raise KeysError(f"{directory} is a client's key directory, not a deployment's")
    o = Path(out)
    if (o / "curve.secret").exists():
        raise KeysError(f"{o / 'curve.secret'} exists: a client's keypair is never replaced (remove the directory)")
    o.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = (k.decode() for k in zmq.curve_keypair())
    for file, value in (("curve.public", public), ("curve.secret", secret), ("http.token", deployment.http_token),
                        ("server.public", deployment.curve_public)):
        _write(o, file, value)
    clients = Path(directory) / "clients"
    clients.mkdir(mode=0o755, exist_ok=True)
    _write(clients, f"{name}.public", public, mode=0o644)
    return clients / f"{name}.public"


def client_keys(directory: str | Path) -> frozenset[bytes]:
    """The public keys admitted in `directory/clients` (a malformed file is skipped: it admits nobody)."""
    found = set()
    for path in (Path(directory) / "clients").glob("*.public"):
        try:
            key = path.read_text().strip()
        except OSError:
            continue
        if len(key) == 40:
            found.add(key.encode())
    return frozenset(found)


CLIENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _write(d: Path, name: str, value: str, mode: int | None = None) -> str:
    tmp = d / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILES[name] if mode is None else mode)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, d / name)
    return name


def load(directory: str | Path) -> DeploymentKeys:
    """The keys, each file checked; a missing or malformed one is refused by its path."""
    d = Path(directory)
    values = {}
    names = (*DEPLOYMENT_FILES, "server.public") if (d / "server.public").exists() else DEPLOYMENT_FILES
    for name in names:
        try:
            values[name] = (d / name).read_text().strip()
        except OSError as exc:
            raise KeysError(f"{d / name}: {exc.strerror} (create the directory with `kvcr keys init {d}`)") from None
    for name in ("curve.public", "curve.secret", *(("server.public",) if "server.public" in values else ())):
        if len(values[name]) != 40:
            raise KeysError(f"{d / name} must hold a 40-character Z85 CURVE key")
    if len(values["http.token"]) < 16:
        raise KeysError(f"{d / 'http.token'} must hold a token of at least 16 characters")
    return DeploymentKeys(values["curve.public"], values["curve.secret"], values["http.token"],
                          values.get("server.public", ""))


def client_http_token() -> str:
    """The token a client (the CLI, the router) sends to a runner's /info: KVCR_HTTP_TOKEN, else the
    one in KVCR_KEYS_DIR, else none."""
    if os.environ.get("KVCR_HTTP_TOKEN"):
        return os.environ["KVCR_HTTP_TOKEN"]
    return load(os.environ["KVCR_KEYS_DIR"]).http_token if os.environ.get("KVCR_KEYS_DIR") else ""
