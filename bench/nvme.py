"""NVMe tier reads and writes against a raw parallel preadv loop, memcpy and SGLang's HiCacheFile.

    .venv/bin/python bench/nvme.py [--repeats 5] [--quick] [--dir /path/on/the/nvme]

Cold reads: every page file is dropped from the page cache (fsync, then POSIX_FADV_DONTNEED)
before each repeat of each system. Baseline: a thread pool of the same size doing open + preadv
into pre-allocated buffers (the device limit). kvcr: DiskTier.read_into (index lookup, preadv,
size and xxh3 digest check). HiCacheFile: its serial get() into a tensor.
Warm reads: the same files in the page cache, against one memcpy of the same bytes.
Writes: a fresh key per page, atomic publish included, against HiCacheFile.set().
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Spread, disk_bench_args, machine_line, publish, table  # noqa: E402
from kvcr.drivers.nvme import DiskTier  # noqa: E402
from kvcr.proto.disk_index import DiskIndex  # noqa: E402
from kvcr.proto.keys import Namespace  # noqa: E402

NS = Namespace(model="bench", page_size=16)


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(pool: ThreadPoolExecutor, paths: list[Path], bufs: list[memoryview]) -> None:
    def one(path: Path, buf: memoryview) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(buf):
                done += os.preadv(fd, [buf[done:]], done)
        finally:
            os.close(fd)
    list(pool.map(one, paths, bufs))


def make_tier(root: Path, page_bytes: int, workers: int) -> DiskTier:
    index = DiskIndex(block_size=16)
    return DiskTier(root, NS, page_bytes=page_bytes, index=index, lock=threading.RLock(), flush=lambda: None,
                    read_workers=workers, write_workers=workers)


def hicache_file(directory: Path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="bench", extra_config={"file_storage_path": str(directory)})
    return HiCacheFile(cfg)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_case(root: Path, page_bytes: int, pages: int, workers: list[int], repeats: int) -> list[str]:
    import torch
    writer = make_tier(root, page_bytes, 4)
    hexes = [f"{i:064x}" for i in range(pages)]
    payload = os.urandom(page_bytes)
    writer.write(hexes, [memoryview(payload)] * pages)
    paths = [writer.path(writer.name(h)) for h in hexes]
    os.sync()
    bufs = [memoryview(bytearray(page_bytes)) for _ in range(pages)]
    for b in bufs:
        b[:] = payload  # destination pre-faulted for every system alike
    total = page_bytes * pages
    hf = hicache_file(writer.dir)
    targets = [torch.empty(page_bytes, dtype=torch.uint8) for _ in range(pages)]
    rows = []
    for w in workers:
        tier = make_tier(root, page_bytes, w)
        tier.scan()
        pool = ThreadPoolExecutor(w)
        raw, ours, theirs = [], [], []
        for i in range(repeats):
            drop_cache(paths)
            raw.append(total / timed(lambda: raw_read(pool, paths, bufs)) / 1e9)
            drop_cache(paths)
            ours.append(total / timed(lambda: tier.read_into(hexes, bufs)) / 1e9)
            drop_cache(paths)
            theirs.append(total / timed(lambda: [hf.get(h, t) for h, t in zip(hexes, targets)]) / 1e9)
            print(f"\r  cold {page_bytes >> 20} MiB x {pages}, {w} workers: repeat {i + 1}/{repeats}", end="",
                  flush=True)
        print()
        assert all(bytes(b) == payload for b in bufs), "read_into delivered different bytes"
        rows.append(f"| cold read | {page_bytes >> 20} MiB | {w} | {Spread.of(raw).fmt()} | {Spread.of(ours).fmt()} | "
                    f"{Spread.of([o / r for o, r in zip(ours, raw)]).fmt(100, 0)} % | {Spread.of(theirs).fmt()} | "
                    f"{Spread.of([o / t for o, t in zip(ours, theirs)]).fmt(1, 1)}x |")
        print(rows[-1])
        pool.shutdown()
        tier.close()
    # Warm: files in the page cache; baseline is one memcpy of the same bytes.
    tier = make_tier(root, page_bytes, max(workers))
    tier.scan()
    src = [memoryview(bytearray(payload)) for _ in range(pages)]  # distinct sources, as page-cache pages are
    memcpy, warm = [], []
    tier.read_into(hexes, bufs)
    for _ in range(repeats):
        def copy() -> None:
            for s, d in zip(src, bufs):
                d[:] = s
        memcpy.append(total / timed(copy) / 1e9)
        warm.append(total / timed(lambda: tier.read_into(hexes, bufs)) / 1e9)
    rows.append(f"| warm read | {page_bytes >> 20} MiB | {max(workers)} | memcpy {Spread.of(memcpy).fmt()} | "
                f"{Spread.of(warm).fmt()} | {Spread.of([o / r for o, r in zip(warm, memcpy)]).fmt(100, 0)} % | | |")
    print(rows[-1])
    tier.close()
    writer.close()
    return rows


def write_case(root: Path, page_bytes: int, pages: int, repeats: int) -> str:
    import torch
    payload = os.urandom(page_bytes)
    tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    total = page_bytes * pages
    ours, theirs = [], []
    for i in range(repeats):
        tier = make_tier(root / f"w{i}", page_bytes, 4)
        hexes = [f"{i:032x}{j:032x}" for j in range(pages)]
        ours.append(total / timed(lambda: tier.write(hexes, [memoryview(payload)] * pages)) / 1e9)
        tier.close()
        hf_dir = root / f"hf{i}"
        hf = hicache_file(hf_dir)
        theirs.append(total / timed(lambda: [hf.set(h, tensor) for h in hexes]) / 1e9)
        shutil.rmtree(root / f"w{i}")
        shutil.rmtree(hf_dir)
    row = (f"| write | {page_bytes >> 20} MiB | 4 | HiCacheFile {Spread.of(theirs).fmt()} | {Spread.of(ours).fmt()} | "
           f"{Spread.of([o / t for o, t in zip(ours, theirs)]).fmt(100, 0)} % | | |")
    print(row)
    return row


def main() -> int:
    args = disk_bench_args(__doc__, repeats=5, quick_help="small sizes, 5 repeats (a smoke run)")
    repeats = max(5, args.repeats)
    root = Path(tempfile.mkdtemp(prefix="kvcr-bench-nvme-", dir=args.dir))
    try:
        cases = [(1 << 20, 16, [1, 4])] if args.quick else [(1 << 20, 128, [1, 2, 4, 8]), (8 << 20, 32, [1, 2, 4, 8])]
        rows = []
        for page_bytes, pages, workers in cases:
            rows += read_case(root / f"r{page_bytes}", page_bytes, pages, workers, repeats)
            rows.append(write_case(root / f"wc{page_bytes}", page_bytes, pages, repeats))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    intro = (f"`python bench/nvme.py --repeats {repeats}` on {machine_line()}, "
             f"files on `{args.dir or tempfile.gettempdir()}`. "
             f"Median (min–max) of {repeats} alternating repeats, GB/s. Cold: every file dropped from the page cache "
             "(fsync + `POSIX_FADV_DONTNEED`) before each system's turn. Baseline for cold reads: a thread pool of "
             "the same size doing open + preadv into pre-allocated buffers (the device limit); for warm reads: one "
             "memcpy of the same bytes; for writes: SGLang `HiCacheFile.set` (serial, `tofile` + rename). kvcr "
             "reads check size and the xxh3 digest of every page; kvcr writes include the temporary file, "
             "`link` publish and manifest record.")
    columns = ["op", "page", "workers", "baseline", "kvcr",
               "kvcr/baseline", "HiCacheFile (cold)", "kvcr/HiCacheFile"]
    publish("nvme", "NVMe tier: reads and writes", intro, [table(columns, rows)],
            write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
