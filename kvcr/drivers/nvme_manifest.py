"""The NVMe tier's manifest file: size, digest and announce of every page a kvcr process wrote to a
directory, as length-prefixed msgpack records that several processes append to under a flock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import uuid
from pathlib import Path
from typing import Iterable, Iterator

import msgpack

from ..proto.announce import Announce

MANIFEST = "manifest.kvcr"
MANIFEST_LOCK = "manifest.lock"
FORMAT_FILE = "format.json"  # on-disk format version and namespace, beside the pages
_RECORD = struct.Struct("<I")

ManifestRecords = dict[str, tuple[int, int | None, "Announce | None"]]


def parse_manifest(data: bytes) -> tuple[ManifestRecords, int]:
    """The manifest's live records (name -> size, digest, announce) and how many records were bad.

    Records are length-prefixed msgpack `["put", name, size, digest, announce]` or `["del", name]`;
    a torn final record (a crash while appending) ends the file, a bad one is counted and skipped."""
    out: ManifestRecords = {}
    bad, pos = 0, 0
    while pos + 4 <= len(data):
        (n,) = _RECORD.unpack_from(data, pos)
        if pos + 4 + n > len(data):
            break
        try:
            _apply_record(out, msgpack.unpackb(data[pos + 4:pos + 4 + n]))
        except (ValueError, TypeError, msgpack.UnpackException):  # EventError is a ValueError
            bad += 1
        pos += 4 + n
    return out, bad


def _apply_record(out: ManifestRecords, rec: object) -> None:
    if not isinstance(rec, list) or not rec or rec[0] not in ("put", "del") or len(rec) != (5 if rec[0] == "put" else 2) \
            or not isinstance(rec[1], str):
        raise ValueError(f"not a manifest record: {rec!r:.80}")
    if rec[0] == "del":
        out.pop(rec[1], None)
        return
    _, name, size, page_digest, announce = rec
    if type(size) is not int or size < 0 or not (page_digest is None or type(page_digest) is int):
        raise ValueError(f"manifest record for {name!r}: size {size!r:.20} or digest {page_digest!r:.20} is not a count")
    out[name] = (size, page_digest, Announce.from_wire(announce) if announce else None)


def put_record(name: str, size: int, digest: int | None, announce: Announce | None) -> list:
    return ["put", name, size, digest, announce.to_wire() if announce else None]


def _pack(records: Iterable[list]) -> bytes:
    return b"".join(_RECORD.pack(len(p)) + p for p in (msgpack.packb(r) for r in records))


class ManifestFile:
    def __init__(self, directory: Path) -> None:
        self.path = directory / MANIFEST
        self._lock_path = directory / MANIFEST_LOCK
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """This process's lock, then the directory's (other processes append too). The flock is on
        its own file: the manifest itself is replaced when compacted."""
        with self._lock:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def append(self, records: Iterable[list]) -> None:
        blob = _pack(records)
        if not blob:
            return
        with self.locked():
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, blob)
            finally:
                os.close(fd)

    def read(self) -> tuple[ManifestRecords, int] | None:
        """The live records, and how many were bad (see parse_manifest); None: no manifest yet."""
        try:
            return parse_manifest(self.path.read_bytes())
        except FileNotFoundError:
            return None

    def replace(self, records: Iterable[list]) -> None:
        """Atomically replace the whole manifest (the caller holds `locked()`)."""
        tmp = self.path.parent / f".{uuid.uuid4().hex}.tmp"
        tmp.write_bytes(_pack(records))
        os.replace(tmp, self.path)
