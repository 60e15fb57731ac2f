"""DRAM pool batch put/get against a single-thread copy between pre-faulted buffers.

    .venv/bin/python bench/dram_pool.py [--repeats 7] [--quick]

Baseline: the same pages copied with memoryview slice assignment (memcpy) from a pre-faulted
source into a pre-faulted destination. Candidate: Runner.put (reserve, copy, commit, event) and
Runner.read_into (claim, copy, release). Bookkeeping per page = (candidate - baseline) / pages.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Spread, alternate, machine_line, publish, table, timed  # noqa: E402
from kvcr.config import load_config  # noqa: E402
from kvcr.proto.announce import announce_request  # noqa: E402
from kvcr.proto.keys import request_page_hashes  # noqa: E402
from kvcr.runner import Runner  # noqa: E402

BLOCK = 16


def _runner(page_bytes: int, pages: int, digests: bool) -> Runner:
    cfg = load_config(None, {"runner.name": f"bench-{page_bytes}{'-digests' if digests else ''}",
                             "runner.block_size": BLOCK, "dram.size": page_bytes * pages + (1 << 20),
                             "dram.max_claim_fraction": 1.0, "runner.verify_transfer_bytes": digests,
                             "dram.pools": [{"name": "kv", "page_bytes": page_bytes}]})
    return Runner(cfg, publish=lambda event: None)


def case(page_bytes: int, pages: int, repeats: int) -> dict:
    runner = _runner(page_bytes, pages, digests=False)
    digesting = _runner(page_bytes, pages, digests=True)  # commit-time digests (what keys turn on)
    src = bytearray(page_bytes * pages)
    src[:] = bytes(range(256)) * (len(src) // 256)
    dst = bytearray(page_bytes * pages)  # written once below: pre-faulted
    src_v, dst_v = memoryview(src), memoryview(dst)
    pages_src = [src_v[i * page_bytes:(i + 1) * page_bytes] for i in range(pages)]
    pages_dst = [dst_v[i * page_bytes:(i + 1) * page_bytes] for i in range(pages)]
    tokens = list(range(pages * BLOCK))
    keys = [runner.key("kv", k) for k in request_page_hashes(tokens, BLOCK)]
    announces = announce_request(tokens, BLOCK)

    def memcpy() -> None:
        for s, d in zip(pages_src, pages_dst):
            d[:] = s

    def put() -> None:
        runner.put("kv", keys, pages_src, announces)

    def fresh_put_digested() -> float:
        digesting.remove("kv", keys)
        return timed(lambda: digesting.put("kv", keys, pages_src, announces))

    def get() -> None:
        assert runner.read_into("kv", keys, pages_dst) == pages

    def fresh_put() -> float:
        runner.remove("kv", keys)
        return timed(put)

    def bookkeeping_put() -> float:  # reserve + commit + event, no bytes copied
        runner.remove("kv", keys)
        t0 = time.perf_counter()
        fill = runner.reserve("kv", keys, announces, lease_s=1e9)
        runner.commit(fill.fill_id)
        return time.perf_counter() - t0

    def bookkeeping_get() -> float:  # claim + release, no bytes copied
        t0 = time.perf_counter()
        runner.release(runner.claim("kv", keys).claim_id)
        return time.perf_counter() - t0

    for warm in (memcpy, put, get):  # fault every page in once
        warm()
    base_put, cand_put = alternate(lambda: timed(memcpy), fresh_put, repeats, f"{page_bytes >> 10} KiB put")
    base_get, cand_get = alternate(lambda: timed(memcpy), lambda: timed(get), repeats, f"{page_bytes >> 10} KiB get")
    assert bytes(dst) == bytes(src), "read_into returned different bytes"
    plain_put, digested_put = alternate(fresh_put, fresh_put_digested, repeats, f"{page_bytes >> 10} KiB digests")
    books = {"put": Spread.of([bookkeeping_put() / pages * 1e6 for _ in range(repeats)]),
             "get": Spread.of([bookkeeping_get() / pages * 1e6 for _ in range(repeats)])}
    runner.shutdown()
    digesting.shutdown()
    out = {"page_bytes": page_bytes, "pages": pages,
           "digests": {"plain": Spread.of([page_bytes * pages / t / 1e9 for t in plain_put]),
                       "digested": Spread.of([page_bytes * pages / t / 1e9 for t in digested_put]),
                       "cost": Spread.of([d / p - 1 for p, d in zip(plain_put, digested_put)])}}
    for name, base, cand in (("put", base_put, cand_put), ("get", base_get, cand_get)):
        gbps_base = [page_bytes * pages / t / 1e9 for t in base]
        gbps_cand = [page_bytes * pages / t / 1e9 for t in cand]
        out[name] = {"base": Spread.of(gbps_base), "cand": Spread.of(gbps_cand),
                     "ratio": Spread.of([c / b for c, b in zip(gbps_cand, gbps_base)]),
                     "overhead_us": Spread.of([(c - b) / pages * 1e6 for c, b in zip(cand, base)]),
                     "books_us": books[name]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="smaller batches, 5 repeats (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    repeats = 5 if args.quick else max(5, args.repeats)
    cases = [(64 << 10, 256), (1 << 20, 256), (4 << 20, 64)] if not args.quick else [(64 << 10, 64), (1 << 20, 32)]
    rows, chart, digest_rows = [], {}, []
    for page_bytes, pages in cases:
        r = case(page_bytes, pages, repeats)
        for op in ("put", "get"):
            x = r[op]
            chart[f"{op}, {page_bytes >> 10} KiB"] = {  # a Spread's three points keep its median, min and max
                "memcpy": [x["base"].low, x["base"].median, x["base"].high],
                "kvcr": [x["cand"].low, x["cand"].median, x["cand"].high]}
            rows.append(f"| {op} | {page_bytes >> 10} KiB | {pages} | {x['base'].fmt()} | {x['cand'].fmt()} | "
                        f"{x['ratio'].fmt(100, 0)} % | {x['overhead_us'].fmt(1, 2)} | {x['books_us'].fmt(1, 2)} |")
            print(rows[-1])
        d = r["digests"]
        digest_rows.append(f"| {page_bytes >> 10} KiB | {pages} | {d['plain'].fmt()} | {d['digested'].fmt()} | "
                           f"{d['cost'].fmt(100, 0)} % |")
        print("digests", digest_rows[-1])
    intro = (f"`python bench/dram_pool.py --repeats {repeats}` on {machine_line()}. Median (min–max) of {repeats} "
             "alternating baseline/candidate repeats. Baseline: memcpy (memoryview slice assignment) between "
             "pre-faulted buffers, same pages. Candidate: `Runner.put` (reserve, copy into the shared-memory "
             "pool, commit, record the `BlockStored` event) and `Runner.read_into` (claim, copy out, release). "
             "Overhead = (candidate − baseline) time per page; it includes the cost of writing into a "
             "different (shared-memory) destination. Bookkeeping = the same batch's reserve + commit "
             "(put) or claim + release (get) with no bytes copied, per page.")
    columns = ["op", "page", "pages/batch", "baseline GB/s", "kvcr GB/s",
               "kvcr/baseline", "overhead µs/page", "bookkeeping µs/page"]
    digests = ("Commit-time page digests (what CURVE keys or `runner.verify_transfer_bytes` turn on: an xxh3-64 of "
               "every page as it is committed), same run: `Runner.put` without and with them, alternating; cost = "
               "time with / time without − 1.")
    publish("dram_pool", "DRAM pool: batch put/get vs. a single-thread copy", intro,
            [table(columns, rows), [digests],
             table(["page", "pages/batch", "put GB/s", "put with digests GB/s", "digest cost"], digest_rows)],
            write=not args.no_write, chart=chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
