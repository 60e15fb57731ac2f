"""A deployment's key directory: what `kvcr keys init DIR` writes and runners, the router and the
CLI read (`runner.keys_dir`, KVCR_KEYS_DIR). Layout (docs/security.md):

    DIR/curve.public   the deployment's CURVE public key (Z85, 40 characters), mode 0644
    DIR/curve.secret   its secret key, mode 0600
    DIR/http.token     the token /info and the router's operator routes ask for, mode 0600
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import zmq

FILES = {"curve.public": 0o644, "curve.secret": 0o600, "http.token": 0o600}


class KeysError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class DeploymentKeys:
    curve_public: str
    curve_secret: str
    http_token: str


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


def _write(d: Path, name: str, value: str) -> str:
    tmp = d / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILES[name])
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, d / name)
    return name


def load(directory: str | Path) -> DeploymentKeys:
    """The keys, each file checked; a missing or malformed one is refused by its path."""
    d = Path(directory)
    values = {}
    for name in FILES:
        try:
            values[name] = (d / name).read_text().strip()
        except OSError as exc:
            raise KeysError(f"{d / name}: {exc.strerror} (create the directory with `kvcr keys init {d}`)") from None
    for name in ("curve.public", "curve.secret"):
        if len(values[name]) != 40:
            raise KeysError(f"{d / name} must hold a 40-character Z85 CURVE key")
    if len(values["http.token"]) < 16:
        raise KeysError(f"{d / 'http.token'} must hold a token of at least 16 characters")
    return DeploymentKeys(values["curve.public"], values["curve.secret"], values["http.token"])


def client_http_token() -> str:
    """The token a client (the CLI, the router) sends to a runner's /info: KVCR_HTTP_TOKEN, else the
    one in KVCR_KEYS_DIR, else none."""
    if os.environ.get("KVCR_HTTP_TOKEN"):
        return os.environ["KVCR_HTTP_TOKEN"]
    return load(os.environ["KVCR_KEYS_DIR"]).http_token if os.environ.get("KVCR_KEYS_DIR") else ""
