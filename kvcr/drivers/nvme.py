"""The NVMe tier's file I/O: one file per page, atomic publish, vectored reads and writes.

Files use SGLang HiCacheFile's naming (`<page hash><suffix>.bin`, raw page bytes), so its
reference backend and this tier read each other's pages. Beside them: `format.json` (on-disk
format version and namespace) and `manifest.kvcr` (size, digest and announce of every page we
wrote, as length-prefixed msgpack records). All bookkeeping decisions live in DiskIndex; this
module performs them and reports back, under the owner's lock.
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import os
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import xxhash

from ..proto.announce import Announce
from ..proto.disk_index import DiskEntry, DiskFull, DiskIndex
from ..proto.keys import PAGE_HEX_DIGITS, KeyFormatError, Namespace, check_page_hex
from .io_stats import LatencyHistogram, ThrottledWarning
from .nvme_manifest import FORMAT_FILE, ManifestFile, ManifestRecords, put_record
from .nvme_scan import StartupScan

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
VERIFY_MODES = ("first_read", "always", "never")


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
        self.num_lost_races = 0
        self.read_latency = LatencyHistogram()
        self.write_latency = LatencyHistogram()
        self.write_failures = ThrottledWarning()
        self.scan_done = threading.Event()
        self._prepare_dir()
        self.manifest = ManifestFile(self.dir)
        self.scanner = StartupScan(self)
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

    def read_manifest(self) -> ManifestRecords:
        read = self.manifest.read()
        if read is None:
            return {}
        records, bad = read
        self.errors["manifest_record"] += bad
        return records

    def compact_manifest(self) -> None:
        """Rewrite the manifest from the index. Under the manifest lock, so no append is lost; our
        own writes commit to the index before they append, so the snapshot has them."""
        with self.manifest.locked():
            with self.lock:
                entries = self.index.entries_root_first()
            records = [put_record(e.name, e.size, e.digest, e.announce) for e in entries if e.digest is not None]
            # Records other processes appended since our scan are kept as they are.
            ours = {e.name for e in entries}
            theirs = {n: v for n, v in self.read_manifest().items() if n not in ours}
            records += [put_record(n, size, d, a) for n, (size, d, a) in theirs.items()]
            self.manifest.replace(records)

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
        self.manifest.append([put_record(e.name, e.size, e.digest, e.announce)
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
            self.count_error(exc)
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
                    self.count_error(exc)

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

    def count_error(self, exc: OSError) -> None:
        self.errors[errno.errorcode.get(exc.errno or 0, "EIO")] += 1

    def _unlink(self, entries: Sequence[DiskEntry]) -> None:
        for entry in entries:
            try:
                os.unlink(self.path(entry.name))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self.count_error(exc)
        self.manifest.append([["del", e.name] for e in entries if e.digest is not None])

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
            self.count_error(exc)
            return False
        try:
            st = os.fstat(fd)
            got = _pread_all(fd, buf[:self.page_bytes]) if st.st_size == self.page_bytes else -1
        except OSError as exc:
            self.count_error(exc)
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
        thread = threading.Thread(target=self.scanner.run, name="kvcr-nvme-scan", daemon=True)
        thread.start()
        return thread

    def scan(self) -> None:
        """Rebuild the inventory from disk (see StartupScan); start_scan runs it in a thread."""
        self.scanner.run()

    def is_page_name(self, stem: object) -> bool:
        """A file name (without `.bin`) this tier's naming gives a page."""
        if not (isinstance(stem, str) and stem.endswith(self.suffix)
                and len(stem) == PAGE_HEX_DIGITS + len(self.suffix)):
            return False
        try:
            check_page_hex(self.page_hex(stem))
        except KeyFormatError:
            return False
        return True

    @property
    def num_foreign(self) -> int:
        return self.scanner.num_foreign

    @property
    def num_stale_temp_removed(self) -> int:
        return self.scanner.num_stale_temp_removed

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
