"""NVMe persistence: store rate with write-behind on and off, burst retention, restart announce time.

    .venv/bin/python bench/nvme_persist.py [--repeats 3] [--quick] [--dir /path/on/the/nvme]

Store rate: Runner.put of 16-page requests (64 KiB pages) into a DRAM pool, sustained past its
size; baseline: the same runner without an NVMe tier (every eviction a drop), in the same run.
Burst retention: a burst of 1x, 3x and 10x DRAM stored at once; kept = pages still in DRAM or on
NVMe over pages stored, for write-behind, spill, and no NVMe tier.
Restart: a directory of N pages in chains of 16; time from DiskTier construction to every page
announced (root first), against a bare scandir + stat of the same files.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Spread, disk_bench_args, machine_line, publish, table  # noqa: E402
from kvcr.config import load_config  # noqa: E402
from kvcr.drivers.nvme import DiskTier  # noqa: E402
from kvcr.proto.announce import announce_request  # noqa: E402
from kvcr.proto.disk_index import DiskIndex  # noqa: E402
from kvcr.proto.events import BlockStored  # noqa: E402
from kvcr.proto.keys import Namespace, request_page_hashes  # noqa: E402
from kvcr.runner import Store, open_store  # noqa: E402

PAGE = 64 << 10
BLOCK = 16
PER_REQUEST = 16


def requests(n: int, seed: int) -> list[tuple[list[str], list, list[bytes]]]:
    rng = random.Random(seed)
    payload = [rng.randbytes(PAGE) for _ in range(PER_REQUEST)]  # bytes are not what is measured
    out = []
    for _ in range(n):
        tokens = [rng.randrange(50000) for _ in range(PER_REQUEST * BLOCK)]
        out.append((request_page_hashes(tokens, BLOCK), announce_request(tokens, BLOCK), payload))
    return out


def make_store(root: Path | None, dram_pages: int, policy: str = "write_behind") -> Store:
    overrides = {"runner.name": "bench", "runner.block_size": BLOCK, "dram.size": dram_pages * PAGE,
                 "dram.pools": [{"name": "kv", "page_bytes": PAGE}]}
    if root is not None:
        overrides |= {"nvme.storage_dir": str(root), "nvme.write_policy": policy}
    return open_store(load_config(None, overrides))


def store_all(store: Store, reqs) -> float:
    runner = store.runner
    t0 = time.perf_counter()
    for hexes, ann, data in reqs:
        runner.put("kv", runner.keys("kv", hexes), data, ann)
    return time.perf_counter() - t0


class Sampler:
    """Dirty pages and write-behind lag, sampled while a run goes; the lag when fills first waited."""

    def __init__(self, store: Store) -> None:
        self.runner, self.lower, self.max_dirty, self.lag_at_wait = store.runner, store.lower, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pool = self.runner.pools["kv"]
        while not self._stop.wait(0.002):
            with self.runner.lock:
                dirty, since, waits = pool.num_dirty, pool.oldest_dirty_since(), self.lower.num_fill_waits
                now = self.runner.clock()
            self.max_dirty = max(self.max_dirty, dirty)
            if waits and self.lag_at_wait is None:
                self.lag_at_wait = (dirty, 0.0 if since is None else now - since)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def store_rate_case(root: Path, dram_pages: int, num_requests: int, repeats: int) -> list[str]:
    off, on, lag_rows = [], [], []
    for i in range(repeats):
        reqs = requests(num_requests, seed=i)
        nbytes = num_requests * PER_REQUEST * PAGE
        store = make_store(None, dram_pages)
        off.append(nbytes / store_all(store, reqs) / 1e9)
        store.shutdown()
        store = make_store(root / f"rate{i}", dram_pages)
        sampler = Sampler(store)
        on.append(nbytes / store_all(store, reqs) / 1e9)
        sampler.stop()
        with store.runner.lock:
            waits, waited = store.lower.num_fill_waits, store.lower.fill_wait_s
            dropped = sum(store.runner.pools["kv"].dropped.values())
        lag_rows.append((sampler.max_dirty, sampler.lag_at_wait, waits, waited, dropped))
        store.shutdown()
        shutil.rmtree(root / f"rate{i}")
        print(f"\r  store rate: repeat {i + 1}/{repeats}", end="", flush=True)
    print()
    max_dirty, lag_at_wait, waits, waited, dropped = lag_rows[len(lag_rows) // 2]
    at_wait = "no fill waited" if lag_at_wait is None else f"{lag_at_wait[0]} dirty pages, {lag_at_wait[1] * 1e3:.0f} ms"
    return [f"| {num_requests * PER_REQUEST} pages into {dram_pages} DRAM slots | "
            f"{Spread.of(off).fmt()} | {Spread.of(on).fmt()} | "
            f"{Spread.of([a / b for a, b in zip(on, off)]).fmt(100, 0)} % | {max_dirty} | {at_wait} | {waits} "
            f"({waited:.2f} s) | {dropped} |"]


def retention_case(root: Path, dram_pages: int, factor: int) -> str:
    num_requests = dram_pages * factor // PER_REQUEST
    reqs = requests(num_requests, seed=factor)
    stored = num_requests * PER_REQUEST
    cells = []
    for policy in ("write_behind", "spill", None):
        store = make_store(root / f"keep{factor}{policy}" if policy else None, dram_pages, policy or "write_behind")
        runner = store.runner
        store_all(store, reqs)
        if policy:
            store.lower.persister.flush(30)
        with runner.lock:
            keys = [k for hexes, _, _ in reqs for k in runner.keys("kv", hexes)]
            pool, disk = runner.pools["kv"], store.lower.disks.get("kv") if policy else None
            kept = sum(pool.get(k) is not None or (disk is not None and disk.name(k.page_hex) in disk.index) for k in keys)
            dropped = sum(pool.dropped.values())
        cells.append(f"{kept / stored * 100:.1f} % ({dropped} dropped)")
        store.shutdown()
        if policy:
            shutil.rmtree(root / f"keep{factor}{policy}")
    print(f"  burst {factor}x DRAM: {cells}")
    return f"| {factor}x ({stored} pages, {dram_pages} in DRAM) | " + " | ".join(cells) + " |"


def restart_case(root: Path, num_pages: int, page_bytes: int) -> str:
    ns = Namespace(model="bench-restart", page_size=BLOCK)
    directory = root / f"restart{num_pages}"
    writer = DiskTier(directory, ns, page_bytes=page_bytes, index=DiskIndex(block_size=BLOCK),
                      lock=threading.RLock(), flush=lambda: None, write_workers=4)
    payload = memoryview(os.urandom(page_bytes))
    rng = random.Random(num_pages)
    for start in range(0, num_pages, 1024):
        hexes, anns = [], []
        for _ in range(1024 // PER_REQUEST):
            tokens = [rng.randrange(50000) for _ in range(PER_REQUEST * BLOCK)]
            hexes += request_page_hashes(tokens, BLOCK)
            anns += announce_request(tokens, BLOCK)
        writer.write(hexes, [payload] * len(hexes), anns)
        print(f"\r  restart {num_pages}: writing {min(start + 1024, num_pages)}/{num_pages}", end="", flush=True)
    writer.close()
    print()
    os.sync()
    t0 = time.perf_counter()
    with os.scandir(writer.dir) as it:
        for entry in it:
            entry.stat()
    floor = time.perf_counter() - t0
    events: list = []
    lock = threading.RLock()
    index = DiskIndex(block_size=BLOCK)

    def flush() -> None:
        with lock:
            events.extend(index.take_events())

    t0 = time.perf_counter()
    tier = DiskTier(directory, ns, page_bytes=page_bytes, index=index, lock=lock, flush=flush)
    tier.scan()
    took = time.perf_counter() - t0
    announced = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    tier.close()
    assert announced == num_pages, f"{announced} of {num_pages} pages announced"
    shutil.rmtree(directory)
    return (f"| {num_pages} pages of {page_bytes >> 10} KiB | {floor:.2f} s | {took:.2f} s | "
            f"{took / floor:.1f}x |")


def main() -> int:
    args = disk_bench_args(__doc__, repeats=3, quick_help="small sizes (a smoke run)")
    root = Path(tempfile.mkdtemp(prefix="kvcr-bench-persist-", dir=args.dir))
    dram = 64 if args.quick else 512
    try:
        # Within DRAM the writer keeps up (its cost is CPU beside the puts); at 4x it sets the pace.
        rate = [row for factor in (1, 4)
                for row in store_rate_case(root, dram, dram * factor // PER_REQUEST, args.repeats)]
        keep = [retention_case(root, dram, f) for f in ((1, 3) if args.quick else (1, 3, 10))]
        restart = [restart_case(root, n, 4096) for n in ((2048,) if args.quick else (10_240, 102_400))]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    intro = (f"`python bench/nvme_persist.py --repeats {args.repeats}{' --quick' if args.quick else ''}` on "
             f"{machine_line()}, files on `{args.dir or tempfile.gettempdir()}`, 64 KiB pages, requests of 16 "
             "pages. Store rate: `Runner.put` of 1x DRAM (into an empty pool: NVMe can keep up) and 4x DRAM (sustained "
             "past it: NVMe sets the pace), median (min–max) GB/s of alternating repeats; "
             "baseline: the same runner without an NVMe tier. Dirty pages: the most seen at once; back-pressure: "
             "dirty pages and the age of the oldest when a fill first had to wait (`nvme.dirty_wait_s`). Burst "
             "retention: pages in DRAM or on NVMe over pages stored, after a burst stored as fast as it goes. "
             "Restart: from `DiskTier` construction to every page announced root first; baseline: `scandir` + "
             "`stat` of the same files.")
    tables = [
        table(["run", "no NVMe (GB/s)", "write-behind (GB/s)", "write-behind / no NVMe", "dirty pages (max)",
               "back-pressure began at", "fills that waited", "dropped"], rate),
        table(["burst", "write-behind", "spill", "no NVMe tier"], keep),
        table(["directory", "scandir + stat", "kvcr scan + announce", "kvcr / baseline"], restart)]
    for t in tables:
        print("\n".join(t))
    publish("nvme_persist", "NVMe tier: write-behind, burst retention, restart", intro, tables,
            write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
