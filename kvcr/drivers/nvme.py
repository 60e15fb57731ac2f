"""The NVMe tier's file I/O: one file per page, atomic publish, vectored reads and writes.

Files use SGLang HiCacheFile's naming (`<page hash><suffix>.bin`, raw page bytes), so its
reference backend and this tier read each other's pages. Beside them: `format.json` (on-disk
format version and namespace) and `manifest.kvcr` (size, digest and announce of every page we
wrote, as length-prefixed msgpack records). All bookkeeping decisions live in DiskIndex; this
module performs them and reports back, under the owner's lock.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import json
import logging
import math
import os
import struct
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import msgpack
import xxhash

from ..proto.announce import Announce
from ..proto.disk_index import DiskEntry, DiskFull, DiskIndex, root_first
from ..proto.keys import PAGE_HEX_DIGITS, KeyFormatError, Namespace, check_page_hex

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
MANIFEST = "manifest.kvcr"
MANIFEST_LOCK = "manifest.lock"
FORMAT_FILE = "format.json"
_RECORD = struct.Struct("<I")
SCAN_BATCH = 1024
VERIFY_MODES = ("first_read", "always", "never")


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


class DiskError(RuntimeError):
    pass


class Written(enum.Enum):
    """What a page write ended as."""

    WRITTEN = "written"
    PRESENT = "present"  # on disk already (ours, or another writer won the race): not rewritten
    FULL = "nvme_full"   # nvme.max_size holds only this page's ancestors and pages being written
    FAILED = "nvme_write_failed"


def hicache_suffix(ns: Namespace) -> str:
    """HiCacheFile's per-deployment file-name suffix (sglang 0.5.23)."""
    model = "-".join(ns.model.split("/"))
    shard = f"_{ns.pp_size}_{ns.pp_rank}" if ns.pp_size > 1 else ""
    return f"_{model}{shard}" if ns.is_mla else f"_{model}_{ns.tp_rank}_{ns.tp_size}{shard}"


def digest(data: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class ThrottledWarning:
    """A warning logged at most once per `interval_s` per kind; the next one says how many were
    held back (a failing disk fails every page: the log should say so once, not per page)."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def warn(self, kind: str, msg: str, *args: object) -> None:
        with self._lock:
            now = self.clock()
            if now - self._last.get(kind, -math.inf) < self.interval_s:
                self._held[kind] += 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        log.warning(msg + (f" ({held} more like it since the last report)" if held else ""), *args)


@dataclass
class LatencyHistogram:
    """Fixed buckets (seconds), filled by the I/O threads and read at scrape time."""

    bounds: tuple[float, ...] = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)
    counts: list[int] = field(default_factory=lambda: [0] * 10)
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if seconds <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += seconds


class DiskTier:
    def __init__(self, root: str | Path, ns: Namespace, *, page_bytes: int, index: DiskIndex,
                 lock: threading.RLock, flush: Callable[[], None], read_workers: int = 4,
                 write_workers: int = 2, fsync: bool = False, min_free_space: int = 0,
                 stale_temp_age_s: float = 600.0, verify: str = "first_read") -> None:
        if verify not in VERIFY_MODES:
            raise DiskError(f"nvme.verify = {verify!r} must be one of {VERIFY_MODES}")
        self.verify = verify
        self.dir = Path(root) / f"ns-{ns.digest}"
        self.namespace = ns
        self.suffix = hicache_suffix(ns)
        self.page_bytes = page_bytes
        self.index = index
        self.lock = lock
        self.flush = flush
        self.fsync = fsync
        self.min_free_space = min_free_space
        self.stale_temp_age_s = stale_temp_age_s
        self.errors: Counter[str] = Counter()
        self.num_foreign = 0
        self.num_stale_temp_removed = 0
        self.num_lost_races = 0
        self.read_latency = LatencyHistogram()
        self.write_latency = LatencyHistogram()
        self.write_failures = ThrottledWarning()
        self.scan_done = threading.Event()
        self._manifest_lock = threading.Lock()
        self._prepare_dir()
        self._readers = ThreadPoolExecutor(read_workers, thread_name_prefix="kvcr-nvme-read")
        self._writers = ThreadPoolExecutor(write_workers, thread_name_prefix="kvcr-nvme-write")
        self._workers = {self._readers: read_workers, self._writers: write_workers}

    # --- layout ------------------------------------------------------------------------------

    def _prepare_dir(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fmt = self.dir / FORMAT_FILE
            mine = {"format_version": FORMAT_VERSION, "namespace": self.namespace.fields(),
                    "page_bytes": self.page_bytes, "file_suffix": self.suffix}
            if fmt.exists():
                theirs = json.loads(fmt.read_text())
                if theirs.get("format_version") != FORMAT_VERSION:
                    raise DiskError(f"{self.dir}: on-disk format version {theirs.get('format_version')} is not "
                                    f"{FORMAT_VERSION}; use another nvme.storage_dir or migrate it")
            else:
                tmp = self.dir / f".{uuid.uuid4().hex}.tmp"
                tmp.write_text(json.dumps(mine, indent=1))
                os.replace(tmp, fmt)
        except OSError as exc:
            raise DiskError(f"nvme.storage_dir: cannot use {self.dir}: {exc.strerror or exc}") from None

    def name(self, page_hex: str) -> str:
        return page_hex + self.suffix

    def page_hex(self, name: str) -> str:
        """The page hash a file name (without `.bin`) carries: name()'s inverse."""
        return name[:PAGE_HEX_DIGITS]

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.bin"

    # --- manifest ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _manifest_locked(self) -> Iterator[None]:
        """This process's lock, then the directory's (other processes append too). The flock is on
        its own file: the manifest itself is replaced when compacted."""
        with self._manifest_lock:
            fd = os.open(self.dir / MANIFEST_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def _append_manifest(self, records: Iterable[list]) -> None:
        blob = b"".join(_RECORD.pack(len(p)) + p for p in (msgpack.packb(r) for r in records))
        if not blob:
            return
        with self._manifest_locked():
            fd = os.open(self.dir / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, blob)
            finally:
                os.close(fd)

    def read_manifest(self) -> dict[str, tuple[int, int | None, Announce | None]]:
        try:
            data = (self.dir / MANIFEST).read_bytes()
        except FileNotFoundError:
            return {}
        records, bad = parse_manifest(data)
        self.errors["manifest_record"] += bad
        return records

    def compact_manifest(self) -> None:
        """Rewrite the manifest from the index. Under the manifest lock, so no append is lost; our
        own writes commit to the index before they append, so the snapshot has them."""
        with self._manifest_locked():
            with self.lock:
                entries = self.index.entries_root_first()
            records = [["put", e.name, e.size, e.digest, e.announce.to_wire() if e.announce else None]
                       for e in entries if e.digest is not None]
            # Records other processes appended since our scan are kept as they are.
            ours = {e.name for e in entries}
            theirs = {n: v for n, v in self.read_manifest().items() if n not in ours}
            records += [["put", n, size, d, a.to_wire() if a else None] for n, (size, d, a) in theirs.items()]
            blob = b"".join(_RECORD.pack(len(p)) + p for p in (msgpack.packb(r) for r in records))
            tmp = self.dir / f".{uuid.uuid4().hex}.tmp"
            tmp.write_bytes(blob)
            os.replace(tmp, self.dir / MANIFEST)

    # --- writes ------------------------------------------------------------------------------------

    def write(self, page_hexes: Sequence[str], views: Sequence[memoryview],
              announces: Sequence[Announce | None] | None = None) -> list[bool]:
        """Publish pages (parallel); True per page that is on disk afterwards."""
        return [w in (Written.WRITTEN, Written.PRESENT) for w in self.write_pages(page_hexes, views, announces)]

    def write_pages(self, page_hexes: Sequence[str], views: Sequence[memoryview],
                    announces: Sequence[Announce | None] | None = None) -> list[Written]:
        """Publish pages in chain order (the I/O in parallel); what became of each.

        Reservations are made here, in order, so a child reserved in the same batch as its parent
        knows the parent is coming (see DiskIndex.reserve)."""
        names = [self.name(h) for h in page_hexes]
        announces = list(announces) if announces else [None] * len(names)
        with self.lock:
            plans = [self._reserve(n, v, a) for n, v, a in zip(names, views, announces)]
        self._unlink([victim for plan in plans if isinstance(plan, list) for victim in plan])
        results = self._fan_out(self._writers, self._write_one, names, list(views), announces, plans)
        # Record and commit in chain order, in one step: parents are announced before their children.
        published = [r for r in results if isinstance(r, DiskEntry)]
        self._append_manifest([["put", e.name, e.size, e.digest, e.announce.to_wire() if e.announce else None]
                               for e in published])
        with self.lock:
            self.index.commit_batch(published)
        self.flush()
        return [Written.WRITTEN if isinstance(r, DiskEntry) else r for r in results]

    def _reserve(self, name: str, view: memoryview, announce: Announce | None) -> list[DiskEntry] | Written:
        """Under the lock: the pages to evict for this write, or why it will not be made."""
        if len(view) != self.page_bytes:
            log.error("nvme write of %s refused: %d bytes; the tier stores %d-byte pages", name, len(view),
                      self.page_bytes)
            return Written.FAILED
        try:
            victims = self.index.reserve(name, len(view), announce)
        except DiskFull:
            return Written.FULL
        return Written.PRESENT if victims is None else victims

    def _fan_out(self, pool: ThreadPoolExecutor, fn: Callable, *columns: list) -> list:
        """fn over the rows of `columns` on the pool, one contiguous chunk per worker (few hand-offs)."""
        n = len(columns[0])
        if n == 0:
            return []
        workers = min(self._workers[pool], n)
        bounds = [n * i // workers for i in range(workers + 1)]

        def chunk(lo: int, hi: int) -> list:
            return [fn(*(col[i] for col in columns)) for i in range(lo, hi)]

        futures = [pool.submit(chunk, bounds[i], bounds[i + 1]) for i in range(workers)]
        return [r for f in futures for r in f.result()]

    def _write_one(self, name: str, view: memoryview, announce: Announce | None,
                   plan: list[DiskEntry] | Written) -> DiskEntry | Written:
        """The published entry (to commit), or what else became of the write."""
        if isinstance(plan, Written):
            return plan
        try:
            return self._write_page(name, view, announce)
        except Exception:  # never leave the name reserved: it would read as "present" forever
            log.exception("nvme write of %s failed", name)
            with self.lock:
                self.index.abort(name)
            return Written.FAILED

    def _write_page(self, name: str, view: memoryview, announce: Announce | None) -> DiskEntry | Written:
        """Write a reserved page to a temporary file and publish it under its name."""
        t0 = time.perf_counter()
        tmp = self.dir / f".{uuid.uuid4().hex}.tmp"
        created = False
        try:
            self._make_room(len(view))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
            try:
                _pwrite_all(fd, view)
                if self.fsync:
                    os.fsync(fd)
                st = os.fstat(fd)  # link() keeps the inode: these bytes are the digest's bytes
            finally:
                os.close(fd)
            page_digest = digest(view)
            try:
                os.link(tmp, self.path(name))  # publish only if absent: the first writer wins
            except FileExistsError:
                self.num_lost_races += 1
                with self.lock:
                    self.index.abort(name)
                return Written.PRESENT
            self.write_latency.observe(time.perf_counter() - t0)
            return DiskEntry(name, len(view), page_digest, announce, (st.st_ino, st.st_mtime_ns))
        except OSError as exc:
            self._count_error(exc)
            self.write_failures.warn(errno.errorcode.get(exc.errno or 0, "EIO"), "nvme write of %s failed: %s", name,
                                     exc)
            with self.lock:
                self.index.abort(name)
            return Written.FAILED
        finally:
            if created:
                try:
                    os.unlink(tmp)
                except OSError as exc:  # e.g. the filesystem went read-only meanwhile
                    self._count_error(exc)

    def _make_room(self, size: int) -> None:
        if not self.min_free_space:
            return
        st = os.statvfs(self.dir)
        short = self.min_free_space + size - st.f_bavail * st.f_frsize
        if short > 0:
            with self.lock:
                victims = self.index.evict_bytes(short)
            self._unlink(victims)
            st = os.statvfs(self.dir)
            if st.f_bavail * st.f_frsize - size < self.min_free_space:
                raise OSError(errno.ENOSPC, f"nvme.min_free_space = {self.min_free_space} bytes would be crossed")

    def _count_error(self, exc: OSError) -> None:
        self.errors[errno.errorcode.get(exc.errno or 0, "EIO")] += 1

    def _unlink(self, entries: Sequence[DiskEntry]) -> None:
        for entry in entries:
            try:
                os.unlink(self.path(entry.name))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._count_error(exc)
        self._append_manifest([["del", e.name] for e in entries if e.digest is not None])

    def evict_to_watermark(self) -> int:
        with self.lock:
            victims = self.index.evict_to_watermark()
        self._unlink(victims)
        self.flush()
        return len(victims)

    def remove(self, page_hexes: Sequence[str]) -> int:
        with self.lock:
            gone = self.index.remove([self.name(h) for h in page_hexes])
        self._unlink(gone)
        self.flush()
        return len(gone)

    # --- reads ---------------------------------------------------------------------------------------

    def present(self, page_hexes: Sequence[str]) -> int:
        """Leading run of pages on disk. Names the index does not know (pages another program wrote,
        or not scanned yet) are looked for on disk, in parallel on the read workers."""
        names = [self.name(h) for h in page_hexes]
        with self.lock:
            known = [name in self.index for name in names]
        unknown = [name for name, k in zip(names, known) if not k]
        found = dict(zip(unknown, self._fan_out(self._readers, self._adopt_from_disk, unknown)))
        return next((i for i, (name, k) in enumerate(zip(names, known)) if not (k or found[name])), len(names))

    def _adopt_from_disk(self, name: str) -> bool:
        try:
            size = os.stat(self.path(name)).st_size
        except OSError:
            return False
        if size != self.page_bytes:
            return False
        with self.lock:
            self.index.adopt(DiskEntry(name, size, None, None), announce=False)
        return True

    def read_into(self, page_hexes: Sequence[str], buffers: Sequence[memoryview]) -> int:
        """Read pages into buffers (parallel); returns the leading run that arrived intact."""
        ok = self._fan_out(self._readers, self._read_one, [self.name(h) for h in page_hexes], list(buffers))
        self.flush()
        n = next((i for i, good in enumerate(ok) if not good), len(ok))
        with self.lock:
            self.index.touch([self.name(h) for h in page_hexes[:n]])
        return n

    def _read_one(self, name: str, buf: memoryview) -> bool:
        with self.lock:
            entry = self.index.get(name)
        if entry is None:
            return False
        t0 = time.perf_counter()
        try:
            fd = os.open(self.path(name), os.O_RDONLY)
        except FileNotFoundError:
            with self.lock:
                self.index.remove([name])
            return False
        except OSError as exc:
            self._count_error(exc)
            return False
        try:
            st = os.fstat(fd)
            got = _pread_all(fd, buf[:self.page_bytes]) if st.st_size == self.page_bytes else -1
        except OSError as exc:
            self._count_error(exc)
            return False
        finally:
            os.close(fd)
        identity = (st.st_ino, st.st_mtime_ns)
        check = entry.digest is not None and (self.verify == "always" or
                                              (self.verify == "first_read" and entry.verified != identity))
        intact = got == self.page_bytes and (not check or digest(buf[:self.page_bytes]) == entry.digest)
        if intact and check:
            entry.verified = identity
        if not intact:
            log.warning("nvme page %s is truncated or corrupt: removed", name)
            with self.lock:
                gone = self.index.remove([name], corrupt=True)
            self._unlink(gone)
            return False
        self.read_latency.observe(time.perf_counter() - t0)
        return True

    # --- startup scan --------------------------------------------------------------------------------

    def start_scan(self) -> threading.Thread:
        thread = threading.Thread(target=self.scan, name="kvcr-nvme-scan", daemon=True)
        thread.start()
        return thread

    def scan(self) -> None:
        """Rebuild the inventory from disk, announcing pages in batches as it goes.

        Pages we wrote are adopted roots first, so parents are announced before their children
        (a consumer that replays or takes a snapshot meanwhile sees whole chains); then the directory is swept for pages other programs wrote, abandoned
        temporary files and foreign files.
        """
        try:
            manifest = self.read_manifest()
            found: list[DiskEntry] = []
            for name, (size, page_digest, announce) in manifest.items():
                if not self._is_page_name(name):
                    self.errors["manifest_record"] += 1
                    continue
                entry = self._check_file(name, size, DiskEntry(name, size, page_digest, announce))
                if entry is not None:
                    found.append(entry)
            ordered = root_first(found)
            for start in range(0, len(ordered), SCAN_BATCH):
                self._adopt_batch(ordered[start:start + SCAN_BATCH])
            batch: list[DiskEntry] = []
            with os.scandir(self.dir) as it:
                for item in it:
                    try:
                        entry = self._sweep_entry(item, manifest)
                    except FileNotFoundError:  # a writer renamed or removed it meanwhile
                        continue
                    if entry is not None:
                        batch.append(entry)
                    if len(batch) >= SCAN_BATCH:
                        self._adopt_batch(batch)
            self._adopt_batch(batch)
            if self.num_stale_temp_removed:
                log.warning("nvme: removed %d temporary file(s) in %s left by writers that died",
                            self.num_stale_temp_removed, self.dir)
            self.compact_manifest()
        except OSError as exc:
            self._count_error(exc)
            log.error("nvme scan of %s failed: %s", self.dir, exc)
        finally:
            self.scan_done.set()

    def _is_page_name(self, stem: object) -> bool:
        if not (isinstance(stem, str) and stem.endswith(self.suffix)
                and len(stem) == PAGE_HEX_DIGITS + len(self.suffix)):
            return False
        try:
            check_page_hex(self.page_hex(stem))
        except KeyFormatError:
            return False
        return True

    def _check_file(self, name: str, expected: int, entry: DiskEntry) -> DiskEntry | None:
        """The entry if its file is whole; a partial or wrong-sized file is removed and counted."""
        path = self.path(name)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        if size != self.page_bytes or size != expected:
            path.unlink(missing_ok=True)  # never served
            with self.lock:
                self.index.num_corrupt += 1
            return None
        return entry

    def _sweep_entry(self, item: os.DirEntry, manifest: dict) -> DiskEntry | None:
        name = item.name
        if name.endswith(".tmp"):
            if time.time() - item.stat().st_mtime >= self.stale_temp_age_s:
                os.unlink(item.path)  # abandoned by a writer that died
                self.num_stale_temp_removed += 1
            return None
        stem = name[:-4]
        if not (name.endswith(".bin") and self._is_page_name(stem)):
            if name not in (MANIFEST, MANIFEST_LOCK, FORMAT_FILE):
                self.num_foreign += 1
            return None
        if stem in manifest:
            return None  # handled in manifest order
        # Written by another program (HiCacheFile): no digest, no tokens; served, never announced.
        return self._check_file(stem, self.page_bytes, DiskEntry(stem, self.page_bytes, None, None))

    def _adopt_batch(self, batch: list[DiskEntry]) -> None:
        with self.lock:
            for entry in batch:
                self.index.adopt(entry)
            self.index.touch([e.name for e in batch])  # each chain's tail is evicted before its head
        batch.clear()
        self.flush()

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)


def _pwrite_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], done)


def _pread_all(fd: int, buf: memoryview) -> int:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], done)
        if n == 0:
            break
        done += n
    return done
