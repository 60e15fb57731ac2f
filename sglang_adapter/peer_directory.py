"""Peers found on one host: each engine's runner leaves its public info in a directory only its
user can write, and every engine follows the others it finds there (extra-config `peers_dir`).

Two engines started by one user on one host then reuse each other's pages with no list to
maintain, as SGLang's stock `file` backend does through its shared directory. The directory is
the trust boundary: it must be ours and closed to other users, or discovery stays off."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import tempfile
from dataclasses import asdict, dataclass
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


def _private(d: Path) -> None:
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PeerDirectoryError(f"peers_dir: {d} is not a directory (a link or a file)")
    if st.st_uid != os.getuid():
        raise PeerDirectoryError(f"peers_dir: {d} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if st.st_mode & 0o022:
        raise PeerDirectoryError(f"peers_dir: {d} is writable by others (mode {st.st_mode & 0o777:o}); chmod 700 it")


def open_private(path: Path) -> Path:
    """Create `path` (and a missing parent) mode 0700, or check that both are ours, real
    directories and closed to others: whoever can write or rename there could name our sources."""
    for d in (path.parent, path):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise PeerDirectoryError(f"peers_dir {path}: cannot create {d}: {exc}") from exc
        _private(d)
    return path


def _started(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), None when it is gone or a zombie: with the
    pid, it names one process (a pid is reused, a start time on one boot is not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True, slots=True)
class Origin:
    """Which process left an entry, and where: enough to tell it is gone when it ran here."""
    hostname: str
    boot: str
    pid_namespace: int
    pid: int
    started: int | None

    @classmethod
    def here(cls) -> "Origin":
        return cls(socket.gethostname(), host_id(), _pid_namespace(), os.getpid(), _started(os.getpid()))

    def gone(self, here: "Origin") -> bool:
        """A process of this host's earlier boot, or of our pid namespace that ended. One elsewhere
        (a directory shared between hosts or containers) is trusted to remove its own entry."""
        if self.hostname != here.hostname:
            return False
        if self.boot != here.boot:
            return True
        return self.pid_namespace == here.pid_namespace and _started(self.pid) != self.started


@dataclass(frozen=True, slots=True)
class PeerEntry:
    """A runner's public info as another engine left it: where to follow and pull from it."""
    control: str
    events: str
    replay: str | None
    events_curve: bool
    namespace_digests: frozenset[str]
    origin: Origin

    @classmethod
    def decode(cls, raw: dict) -> "PeerEntry":
        info, o = raw["info"], raw["origin"]
        ep = info["endpoints"]
        return cls(control=str(ep["control"]), events=str(ep["events"]), replay=ep.get("replay"),
                   events_curve=info.get("events_curve") is True,
                   namespace_digests=frozenset(str(p["namespace_digest"]) for p in info.get("pools", [])),
                   origin=Origin(str(o["hostname"]), str(o["boot"]), int(o["pid_namespace"]), int(o["pid"]),
                                 None if o["started"] is None else int(o["started"])))


class PeerDirectory:
    """Our entry in the directory, and the others' entries."""

    def __init__(self, path: Path) -> None:
        self.path = open_private(path)
        self.here = Origin.here()
        self.own: Path | None = None
        self._info: dict | None = None
        self._skipped: set[str] = set()  # unreadable entries, warned about once

    def join(self, info: dict) -> Path:
        self._info = info
        name = f"{self.here.boot}-{self.here.pid}-{info['incarnation']}.json"
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps({"origin": asdict(self.here), "info": info}))
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path / name)  # a reader sees the whole file or none
        self.own = self.path / name
        return self.own

    def rejoin(self) -> None:
        """Put our entry back if it went (a runtime directory emptied at logout, an operator's rm)."""
        if self._info is not None and self.own is not None and not self.own.exists():
            log.info("peers_dir: our entry in %s was gone: written again", self.path)
            open_private(self.path)
            self.join(self._info)

    def leave(self) -> None:
        """Remove our entry; only the process that wrote it does (not a forked child)."""
        if self.own is not None and os.getpid() == self.here.pid:
            self.own.unlink(missing_ok=True)
        self.own = self._info = None

    def entries(self) -> dict[str, PeerEntry]:
        """file name -> entry, for every live peer but us; a gone peer's file is removed, an
        unreadable one skipped with a warning."""
        found: dict[str, PeerEntry] = {}
        for p in sorted(self.path.glob("*.json")):
            if p == self.own:
                continue
            try:
                entry = PeerEntry.decode(json.loads(p.read_text()))
            except FileNotFoundError:
                continue  # left while we listed
            except (OSError, ValueError, KeyError, TypeError) as exc:
                if p.name not in self._skipped:
                    self._skipped.add(p.name)
                    log.warning("peers_dir: %s is not a runner's entry, skipped: %s", p.name, exc)
                continue
            if entry.origin.gone(self.here):
                log.info("peers_dir: %s's process %d is gone: entry removed", p.name, entry.origin.pid)
                p.unlink(missing_ok=True)
                continue
            found[p.name] = entry
        return found
