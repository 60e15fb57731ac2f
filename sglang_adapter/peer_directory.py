"""Peers found on one host: each engine's runner leaves its public info in a directory only its
user can write, and every engine follows the others it finds there (extra-config `peers_dir`).

Two engines started by one user on one host then reuse each other's pages with no list to
maintain, as SGLang's stock `file` backend does through its shared directory. The directory is
the trust boundary: it must be ours and closed to other users, or discovery stays off."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvcr.drivers.shm import host_id

log = logging.getLogger(__name__)
AUTO = "auto"


class PeerDirectoryError(ValueError):
    pass


def resolve(peers_dir: str, env: dict | None = None, uid: int | None = None) -> Path | None:
    """The directory `peers_dir` names: "" is off, "auto" the user's runtime directory
    ($XDG_RUNTIME_DIR/kvcr/peers, else <tmp>/kvcr-<uid>/peers), anything else a path."""
    if not peers_dir:
        return None
    if peers_dir != AUTO:
        return Path(peers_dir)
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    runtime = env.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvcr" if runtime else Path(env.get("TMPDIR") or tempfile.gettempdir()) / f"kvcr-{uid}"
    return base / "peers"


def open_private(path: Path) -> Path:
    """Create `path` (and a missing parent we own) mode 0700, or check an existing one is ours and
    closed to others: anyone who can write there could name a source for our pulls."""
    for d in (path.parent, path):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise PeerDirectoryError(f"peers_dir {path}: cannot create {d}: {exc}") from exc
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PeerDirectoryError(f"peers_dir {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if st.st_mode & 0o022:
        raise PeerDirectoryError(f"peers_dir {path} is writable by others (mode {st.st_mode & 0o777:o}); "
                                 "chmod 700 it")
    return path


@dataclass(frozen=True, slots=True)
class PeerEntry:
    """A runner's public info as another engine left it: where to follow and pull from it."""
    control: str
    events: str
    replay: str | None
    events_curve: bool
    namespace_digests: frozenset[str]
    pid: int
    host: str

    @classmethod
    def from_info(cls, info: dict, pid: int) -> "PeerEntry":
        ep = info["endpoints"]
        return cls(control=str(ep["control"]), events=str(ep["events"]), replay=ep.get("replay"),
                   events_curve=info.get("events_curve") is True,
                   namespace_digests=frozenset(str(p["namespace_digest"]) for p in info.get("pools", [])),
                   pid=int(pid), host=str(info.get("host_id", "")))

    def alive(self) -> bool:
        """A process on this host that is gone left its file behind (killed); one elsewhere (a shared
        directory) is trusted to remove its own."""
        if self.host != host_id():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class PeerDirectory:
    """Our entry in the directory, and the others' entries."""

    def __init__(self, path: Path) -> None:
        self.path = open_private(path)
        self.own: Path | None = None

    def join(self, info: dict) -> Path:
        name = f"{host_id()}-{os.getpid()}-{info['incarnation']}.json"
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps({"pid": os.getpid(), "info": info}))
        os.chmod(tmp, 0o600)
        self.own = self.path / name
        os.replace(tmp, self.own)  # a reader sees the whole file or none
        return self.own

    def leave(self) -> None:
        if self.own is not None:
            self.own.unlink(missing_ok=True)
            self.own = None

    def entries(self) -> dict[str, PeerEntry]:
        """file name -> entry, for every live peer but us; a dead peer's file is removed, an
        unreadable one skipped with a warning."""
        found: dict[str, PeerEntry] = {}
        for p in sorted(self.path.glob("*.json")):
            if p == self.own:
                continue
            try:
                raw = json.loads(p.read_text())
                entry = PeerEntry.from_info(raw["info"], raw["pid"])
            except FileNotFoundError:
                continue  # left while we listed
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("peers_dir: %s is not a runner's entry, skipped: %s", p.name, exc)
                continue
            if not entry.alive():
                log.info("peers_dir: %s's process %d is gone: entry removed", p.name, entry.pid)
                p.unlink(missing_ok=True)
                continue
            found[p.name] = entry
        return found
