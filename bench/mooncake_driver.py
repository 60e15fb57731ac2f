"""Mooncake's Transfer Engine and Store, driven the way bench/vs_mooncake.py measures kvcr.

Runs in the Mooncake environment (`.venv-mooncake`: stdlib and the `mooncake` wheel only):

    python bench/mooncake_driver.py te|store PAGES PAGE_BYTES ITERATIONS

`te`: a source process registers PAGES pages; this process reads them all with one
`batch_transfer_sync_read` per transfer (TCP, peer-to-peer handshake, no metadata server).
`store`: `mooncake_master` runs; a putter process puts the pages into its own segment, and this
process, holding no segment, `batch_get_into`s them: true peer reads. Every transfer lands in one
of 4 destination copies used in turn and its bytes are checked. Prints {"seconds": [...]}.
Traffic stays on loopback (`MC_TCP_BIND_ADDRESS=127.0.0.1`, ../shared/reference).
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROTATION = 4
HOST = "127.0.0.1"
libc = ctypes.CDLL(None)
libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
libc.memcmp.restype = ctypes.c_int


def pattern(pages: int, page_bytes: int) -> ctypes.Array:
    """Page i is the byte i % 251 repeated, as kvcr's side of the bench puts."""
    return ctypes.create_string_buffer(b"".join(bytes([i % 251]) * page_bytes for i in range(pages)),
                                       pages * page_bytes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def timed_reads(read, pages: int, page_bytes: int, iterations: int, dest: ctypes.Array) -> list[float]:
    total = pages * page_bytes
    expected = pattern(pages, page_bytes)
    times = []
    for it in range(iterations + 1):  # the first is a warm-up
        base = ctypes.addressof(dest) + it % ROTATION * total
        t0 = time.perf_counter()
        read([base + i * page_bytes for i in range(pages)])
        times.append(time.perf_counter() - t0)
        if libc.memcmp(base, expected, total) != 0:
            raise SystemExit("wrong bytes delivered")
        ctypes.memset(base, 0, total)
    return times[1:]


def child(role: str, *args: object) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, __file__, role, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("{"):
            return proc, json.loads(line)
    raise SystemExit(f"{role} exited before it was ready")


def engine():
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    if te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("TransferEngine.initialize failed")
    return te


def te_source(pages: int, page_bytes: int) -> None:
    te, buf = engine(), pattern(pages, page_bytes)
    addr = ctypes.addressof(buf)
    if te.register_memory(addr, len(buf)) != 0:
        raise SystemExit("register_memory failed")
    print(json.dumps({"peer": f"{HOST}:{te.get_rpc_port()}", "addr": addr}), flush=True)
    sys.stdin.read()  # until the reader is done


def te_read(pages: int, page_bytes: int, iterations: int) -> list[float]:
    proc, info = child("te-source", pages, page_bytes)
    try:
        te = engine()
        dest = ctypes.create_string_buffer(ROTATION * pages * page_bytes)
        if te.register_memory(ctypes.addressof(dest), len(dest)) != 0:
            raise SystemExit("register_memory failed")
        remote = [info["addr"] + i * page_bytes for i in range(pages)]

        def read(local: list[int]) -> None:
            if te.batch_transfer_sync_read(info["peer"], local, remote, [page_bytes] * pages) != 0:
                raise SystemExit("batch_transfer_sync_read failed")
        return timed_reads(read, pages, page_bytes, iterations, dest)
    finally:
        proc.stdin.close()
        proc.wait(30)


def store_client(master: str, metadata: str, segment: int, local_buffer: int):
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    if store.setup(HOST, metadata, segment, local_buffer, "tcp", "", master) != 0:
        raise SystemExit("MooncakeDistributedStore.setup failed")
    return store


def store_putter(pages: int, page_bytes: int, master: str, metadata: str) -> None:
    buf = pattern(pages, page_bytes)
    store = store_client(master, metadata, 2 * len(buf) + (64 << 20), 64 << 20)
    addr = ctypes.addressof(buf)
    store.register_buffer(addr, len(buf))
    keys = [f"page-{i}" for i in range(pages)]
    results = store.batch_put_from(keys, [addr + i * page_bytes for i in range(pages)], [page_bytes] * pages)
    if any(r != 0 for r in results):
        raise SystemExit(f"batch_put_from failed: {results}")
    print(json.dumps({"keys": keys}), flush=True)
    sys.stdin.read()
    store.close()


def store_get(pages: int, page_bytes: int, iterations: int) -> list[float]:
    port, http = free_port(), free_port()
    binary = Path(sys.executable).parent / "mooncake_master"
    master_proc = subprocess.Popen([str(binary), f"--rpc_address={HOST}", f"--rpc_port={port}",
                                    "--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
                                    f"--http_metadata_server_port={http}", f"--metrics_host={HOST}",
                                    f"--metrics_port={free_port()}"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    master, metadata = f"{HOST}:{port}", f"http://{HOST}:{http}/metadata"
    try:
        deadline = time.monotonic() + 30
        while socket.socket().connect_ex((HOST, port)) != 0:
            if time.monotonic() > deadline:
                raise SystemExit("mooncake_master did not come up")
            time.sleep(0.1)
        proc, info = child("store-putter", pages, page_bytes, master, metadata)
        try:
            store = store_client(master, metadata, 0, 64 << 20)  # no segment: every get reads the putter's
            dest = ctypes.create_string_buffer(ROTATION * pages * page_bytes)
            store.register_buffer(ctypes.addressof(dest), len(dest))

            def read(local: list[int]) -> None:
                got = store.batch_get_into(info["keys"], local, [page_bytes] * pages)
                if any(n != page_bytes for n in got):
                    raise SystemExit(f"batch_get_into failed: {got}")
            return timed_reads(read, pages, page_bytes, iterations, dest)
        finally:
            proc.stdin.close()
            proc.wait(30)
    finally:
        master_proc.terminate()
        master_proc.wait(30)


def main(argv: list[str]) -> int:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)  # its data must stay on loopback
    role, rest = argv[0], argv[1:]
    if role == "te-source":
        te_source(int(rest[0]), int(rest[1]))
    elif role == "store-putter":
        store_putter(int(rest[0]), int(rest[1]), rest[2], rest[3])
    else:
        pages, page_bytes, iterations = map(int, rest)
        seconds = (te_read if role == "te" else store_get)(pages, page_bytes, iterations)
        print(json.dumps({"seconds": seconds}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # its threads and atexit hooks can hang or crash an orderly exit


if __name__ == "__main__":
    main(sys.argv[1:])
