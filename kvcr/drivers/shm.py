"""The runner's DRAM region: one page-aligned shared-memory file, mapped once.

Space is reserved with posix_fallocate at start, so a full /dev/shm is a startup error that
names the config key rather than a SIGBUS on first touch later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import resource
import subprocess
import sys
from dataclasses import dataclass

import numpy

SHM_DIR = "/dev/shm"

log = logging.getLogger(__name__)


class RegionError(RuntimeError):
    pass


def shm_free_bytes(directory: str = SHM_DIR) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def memlock_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft  # RLIM_INFINITY is -1 on Linux


def check_capacity(size: int, *, lock_memory: bool, directory: str = SHM_DIR, key: str = "dram.size") -> None:
    free = shm_free_bytes(directory)
    if size > free:
        raise RegionError(f"{key} = {size} bytes does not fit in {directory} ({free} bytes free); "
                          f"lower {key} or enlarge {directory} (docker: shm_size)")
    limit = memlock_limit()
    if lock_memory and limit != resource.RLIM_INFINITY and size > limit:
        raise RegionError(f"{key} = {size} bytes exceeds the memlock limit ({limit} bytes) while "
                          f"dram.lock_memory is true; raise `ulimit -l` (docker: ulimits.memlock) or "
                          f"set dram.lock_memory = false")


def host_id() -> str:
    """Same value for every process of one booted host (and /dev/shm): the boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def region_name(runner: str, pid: int, incarnation: str) -> str:
    return f"kvcr-{runner}-{pid}-{incarnation}"


def _owner_pid(name: str) -> int | None:
    """The pid in a region's name (`region_name`), or None for a file that is not a region."""
    parts = name.rsplit("-", 2)
    if not name.startswith("kvcr-") or len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


def _owner_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by another user
        pass
    return False


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove regions whose owning process is gone (a runner killed before it could unlink), and
    say which: a reclaimed region means some runner did not shut down cleanly."""
    removed = []
    for name in sorted(os.listdir(directory)):
        pid = _owner_pid(name)
        if pid is None or not _owner_gone(pid):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            continue  # another process starting at the same time swept it first
        removed.append(name)
    if removed:
        log.warning("reclaimed %d shared-memory region(s) in %s left by processes that are gone: %s",
                    len(removed), directory, ", ".join(removed))
    return removed


# Runs detached (double fork: out of the owner's process tree, which engines kill whole): waits
# for the owner to exit, however it exits, and unlinks its region if it is still there, with its
# companions (`<region>.<suffix>`: the same-host control socket).
_REAPER = """
import glob, os, select, sys, time
if os.fork():
    os._exit(0)
os.setsid()
pid, path = int(sys.argv[1]), sys.argv[2]
try:
    fd = os.pidfd_open(pid)
except OSError:
    fd = None
while os.path.exists(path):  # closed normally: the owner unlinked it, nothing to watch
    if fd is not None:
        if select.select([fd], [], [], 5.0)[0]:
            break
    elif not os.path.exists("/proc/%d" % pid):
        break
    else:
        time.sleep(0.5)
for name in [path, *glob.glob(glob.escape(path) + ".*")]:  # the region, then its companions
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
"""


def reap_on_exit(path: str) -> None:
    """Unlink `path` once this process is gone, even if it is SIGKILLed (SGLang kills its
    schedulers; a runner inside one never reaches its close). Best effort: without a watcher the
    next runner's sweep reclaims the region."""
    try:
        subprocess.run([sys.executable, "-S", "-c", _REAPER, str(os.getpid()), path], check=True, timeout=10,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("no watcher for %s (a kill leaves it until the next runner's sweep): %s", path, exc)


@dataclass
class Region:
    path: str
    size: int
    mm: mmap.mmap
    owner: bool

    @property
    def view(self) -> memoryview:
        return memoryview(self.mm)

    @property
    def address(self) -> int:
        # numpy reads the pointer of read-only maps too (ctypes' from_buffer needs a writable one);
        # the temporary array is dropped at once, so no buffer export outlives this call.
        return int(numpy.frombuffer(self.mm, dtype=numpy.uint8).ctypes.data)

    @classmethod
    def create(cls, name: str, size: int, *, lock_memory: bool = False, directory: str = SHM_DIR) -> "Region":
        sweep_stale(directory)
        check_capacity(size, lock_memory=lock_memory, directory=directory)
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise RegionError(f"dram.size = {size} bytes could not be reserved in {directory}: {exc}") from None
        os.close(fd)
        region = cls(path, size, mm, owner=True)
        reap_on_exit(path)
        if lock_memory:
            try:
                region._lock()
            except RegionError:
                region.close()
                raise
        return region

    @classmethod
    def attach(cls, path: str, *, writable: bool = True) -> "Region":
        """Map an existing runner's region (another process: a TP rank, a self-check, a puller)."""
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise RegionError(f"{path} is empty: not a runner's pool")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        return cls(path, size, mm, owner=False)

    def _lock(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.mlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.size)) != 0:
            err = ctypes.get_errno()
            raise RegionError(f"mlock of dram.size = {self.size} bytes failed: {os.strerror(err)}")

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass  # an exported view is still alive; the mapping goes with the process
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
