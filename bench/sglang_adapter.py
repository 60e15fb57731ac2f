"""KVCRStorage.batch_get_v1 from a peer into real SGLang host-pool pages, against the runner-level
pull of the same pages (the baseline), a local DRAM hit, and SGLang's own HiCacheFile.

    .venv/bin/python bench/sglang_adapter.py [--repeats 7] [--quick]

Geometry: a 28-layer model with 2 KV heads of 128 dims in bf16, pages of 64 tokens, page_first
host layout: 1.75 MiB per page. Backends A (holds the pages) and B (pulls them) live in this
process, each with its own runner and UCX worker (shared memory + TCP on loopback). The p99 of
the 8k- and 32k-token remote pulls gives the `prefetch_timeout_*` settings (2x margin).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Spread, machine_line, publish, table, timed  # noqa: E402
from kvcr.drivers.ucx_env import SINGLE_HOST_UCX_ENV  # noqa: E402

LAYERS, HEADS, DIM, PAGE = 28, 2, 128, 64
TOKENS = (8192, 32768)
# The adapter's default ("auto": same-host peers are copied from their mapped pool), then UCX GETs,
# which UCX emulates over shared memory on one host (cross-host they are RDMA reads).
TRANSPORTS = {"auto": "same-host copy (default)", "get": "UCX GET (emulated on one host)"}
DEFAULT_TRANSPORT = "auto"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="8k tokens only, 3 repeats, nothing written")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--layers", type=int, default=LAYERS, help="model layers (fewer: a smoke run)")
    args = parser.parse_args()
    sizes = TOKENS[:1] if args.quick else TOKENS
    repeats = 3 if args.quick else args.repeats

    for k, v in SINGLE_HOST_UCX_ENV.items():
        os.environ.setdefault(k, v)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvcr.proto.hints import build_envelope
    from kvcr.proto.keys import U64_MASK, hash_str_to_int64, page_hashes
    from tests.sglang_pools import fill, make_backend, mha_pool, page_bytes  # real SGLang pools (stubs torchvision)

    most = max(sizes)
    # Host pools are twice the device's: room for the pulled pages of every size and HiCacheFile's.
    pools = [mha_pool("page_first", layers=args.layers, heads=HEADS, dim=DIM, page=PAGE, tokens=most + most // 4)
             for _ in range(2)]
    # Host pages are taken once: a backend must see SGLang's slots, not a recycled allocator.
    slots = {t: (pools[0].alloc(t), pools[1].alloc(t)) for t in sizes}
    rows, timeout_rows, file_rows = [], [], []
    p99 = {}
    for transport in TRANSPORTS:
        runner = {"dram.size": f"{most // PAGE * 2 + 16}Mi", "dram.max_claim_fraction": 1.0,
                  "runner.transfer": transport}
        a, b = (make_backend(p, runner=runner) for p in pools)
        page_mib = a.layouts["kv"].bytes / 2**20
        print(f"{transport}: page {page_mib:.2f} MiB ({a.layouts['kv'].bytes} B), {machine_line()}")
        try:
            for tokens in sizes:
                n = tokens // PAGE
                keys = page_hashes(list(range(tokens)), PAGE)
                src, dst = slots[tokens]
                fill(pools[0], src, seed=tokens)
                assert a.batch_set_v1(keys, src) == [True] * n
                endpoint = a.service.control.bound_endpoint
                info = HiCacheStorageExtraInfo(extra_info={"kv_hints": build_envelope(
                    endpoint, [hash_str_to_int64(k) & U64_MASK for k in keys])})

                def runner_pull() -> float:
                    t = timed(lambda: b.pulls.pull_from(endpoint, "kv", keys))
                    b.clear()
                    return t

                def adapter_pull() -> float:
                    t0 = time.perf_counter()
                    assert b.batch_exists(keys, info) == n
                    assert b.batch_get_v1(keys, dst) == [True] * n
                    t = time.perf_counter() - t0
                    # the copy into B's runner runs after the read: timed apart, not overlapped
                    kept.append(timed(b.wait_kept))
                    b.clear()
                    return t

                def local_hit() -> float:
                    return timed(lambda: a.batch_get_v1(keys, dst))

                kept: list[float] = []
                first = runner_pull()  # warm-up, and B's first contact with A: endpoints, rkeys, page faults
                adapter_pull()
                base, cand, local = [], [], []
                for i in range(repeats):
                    base.append(runner_pull())
                    cand.append(adapter_pull())
                    local.append(local_hit())
                    print(f"\r  {tokens} tokens: repeat {i + 1}/{repeats}", end="", flush=True)
                print()
                adapter_pull()  # once more, to check the bytes outside the timing
                assert page_bytes(pools[1], dst) == page_bytes(pools[0], src)
                mib = n * page_mib
                overhead = [c / r - 1 for c, r in zip(cand, base)]
                rows.append(f"| {TRANSPORTS[transport]} | {tokens} | {n} | "
                            f"{Spread.of([mib / 1024 / t for t in base]).fmt()} | "
                            f"{Spread.of([mib / 1024 / t for t in cand]).fmt()} | "
                            f"{statistics.median(overhead) * 100:+.0f}% | "
                            f"{Spread.of(kept[1:1 + repeats]).fmt(1e3, 1)} |")
                if transport == DEFAULT_TRANSPORT:
                    p99[tokens] = max(cand)  # a handful of repeats: the slowest stands in for p99
                    timeout_rows.append(f"| {tokens} | {Spread.of(cand).fmt(1e3, 1)} | {p99[tokens] * 1e3:.1f} | "
                                        f"{first * 1e3:.0f} |")
                    file_rows.append(f"| {tokens} | {_hicache_file(pools[0], keys, src, tokens, repeats, mib).fmt()}"
                                     f" | {Spread.of([mib / 1024 / t for t in local]).fmt()} |")
                a.clear()
        finally:
            a.close()
            b.close()
    base_s, per_ki = recommend(p99)
    print(f"recommended: prefetch_timeout_base={base_s}, prefetch_timeout_per_ki_token={per_ki}")
    tables = [table(["transfer", "tokens", "pages", "runner pull GB/s", "adapter pull GB/s", "adapter overhead",
                     "kept after, ms"], rows),
              table(["tokens", "remote pull ms", "p99 (slowest) ms", "first contact ms"], timeout_rows),
              table(["tokens", "HiCacheFile get (page cache) GB/s", "kvcr local hit GB/s"], file_rows)]
    for t in tables:
        print("\n".join(t))
    budget = "; ".join(f"{t // 1024}k: {base_s + per_ki * t / 1024:.2f} s for a p99 of {p99[t]:.3f} s"
                       for t in sizes)
    publish("sglang_adapter", "SGLang adapter: peer pulls into host-pool pages",
            f"`bench/sglang_adapter.py --repeats {repeats}`, {machine_line()}. Real SGLang 0.5.23 MHA host pools "
            f"(page_first, {args.layers} layers x {HEADS} KV heads x {DIM} dims, bf16, {PAGE}-token pages: "
            f"{args.layers * HEADS * DIM * PAGE * 2 * 2 / 2**20:.2f} MiB per page). GB/s: median (min–max). "
            "Baseline: `PeerPulls.pull_from` of the same "
            "pages into B's DRAM pool (claim, transfer, release). Adapter: `batch_exists` with the hint "
            "(confirm + claim) then `batch_get_v1`, which reads the pages straight into B's host pages "
            "(their K and V segments) with the same transport. *Kept after*: how long the copy of the pulled "
            "pages into B's runner (so the next request hits there) still ran once `batch_get_v1` returned; "
            "it runs on the backend's keeper thread, outside the timed read. Last table: local hits (pages in the "
            "backend's own runner) against SGLang's `file` backend read back from the page cache.",
            [*tables[:2], [f"Timeouts with a 2x margin: `prefetch_timeout_base = {base_s}`, "
              f"`prefetch_timeout_per_ki_token = {per_ki}` ({budget}). SGLang's defaults (1 s + 0.25 s/1k) "
              "are what the launcher replaces."], tables[2]],
            write=not (args.quick or args.no_write))
    return 0


def recommend(p99: dict[int, float]) -> tuple[float, float]:
    """Base and per-1k-token terms whose budget is at least 2x every measured p99 (rounded up)."""
    import math
    sizes = sorted(p99)
    per_ki = 2 * max(p99[sizes[-1]] - p99[sizes[0]], 0.0) / max(1, (sizes[-1] - sizes[0]) / 1024) \
        if len(sizes) > 1 else 0.0
    per_ki = math.ceil(per_ki * 100) / 100
    base = max(2 * p99[t] - per_ki * t / 1024 for t in sizes)
    return math.ceil(max(base, 0.5) * 10) / 10, per_ki


def _hicache_file(pool, keys, src, tokens, repeats, mib) -> Spread:
    """SGLang's `file` backend through the controller's byte-copy path, files warm in the page cache."""
    from sglang.srt.managers.cache_controller import PrefetchOperation
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    from tests.sglang_pools import controller, storage_config

    with tempfile.TemporaryDirectory(prefix="kvcr-bench-hicachefile-") as tmp:
        cfg = storage_config(layout="page_first")
        cfg.extra_config = {"file_storage_path": tmp}
        store = HiCacheFile(cfg)
        store.register_mem_pool_host(pool)
        cc = controller(store, pool)
        cc.page_get_func = cc._generic_page_get
        assert store.batch_set(keys, [pool.get_data_page(int(src[i * PAGE])) for i in range(len(keys))])
        dst = pool.alloc(tokens)  # a third set of host pages (SGLang's `file` reads into these)

        def get() -> float:
            op = PrefetchOperation("bench", [0] * tokens, prefix_keys=[])
            op.hash_value, op.host_indices = keys, dst
            t = timed(lambda: cc._page_transfer(op))
            while not cc.prefetch_sync_queue.empty():
                cc.prefetch_sync_queue.get_nowait()
            return t

        get()
        times = [get() for _ in range(repeats)]
        pool.free(dst)
    return Spread.of([mib / 1024 / t for t in times])


if __name__ == "__main__":
    sys.exit(main())
