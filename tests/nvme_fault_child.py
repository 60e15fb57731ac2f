"""Runs one NVMe fault scenario for real, in a child process (see test_nvme_faults.py).

    python -m tests.nvme_fault_child SCENARIO DIR RESULT_JSON [UNREACHABLE_DIR]

enospc/erofs run inside `unshare -m` on a small tmpfs mounted at DIR; eacces drops to uid
nobody first. The result is written to RESULT_JSON (never stdout).
"""

import json
import os
import subprocess
import sys
import threading

from kvcr.drivers.nvme import DiskError, DiskTier
from kvcr.proto.disk_index import DiskIndex
from kvcr.proto.keys import Namespace

PAGE = 64 * 1024
NS = Namespace(model="fault", page_size=4)


def tier(root):
    lock = threading.RLock()
    index = DiskIndex(block_size=4)
    return DiskTier(root, NS, page_bytes=PAGE, index=index, lock=lock, flush=lambda: None)


def page(i):
    return bytes([i % 251]) * PAGE


def key(i):
    return f"{i:064x}"


def check_intact(t, n):
    bufs = [bytearray(PAGE) for _ in range(n)]
    got = t.read_into([key(i) for i in range(n)], [memoryview(b) for b in bufs])
    return got == n and all(bytes(b) == page(i) for i, b in enumerate(bufs))


def enospc(root):
    t = tier(root)
    stored = 0
    for i in range(64):  # 4 MiB into a 1 MiB tmpfs
        if not t.write([key(i)], [memoryview(page(i))])[0]:
            break
        stored += 1
    failed_again = t.write([key(999)], [memoryview(page(999))])[0] is False
    tmp_left = [n for n in os.listdir(t.dir) if n.endswith(".tmp")]
    return {"stored": stored, "failed_again": failed_again, "errors": dict(t.errors),
            "intact": check_intact(t, stored), "tmp_left": tmp_left}


def erofs(root):
    t = tier(root)
    ok = t.write([key(i) for i in range(3)], [memoryview(page(i)) for i in range(3)])
    subprocess.run(["mount", "-o", "remount,ro", root], check=True)
    refused = t.write([key(7)], [memoryview(page(7))])
    return {"before": ok, "refused": refused, "errors": dict(t.errors), "intact": check_intact(t, 3)}


def eacces(root):
    t = tier(root)  # created by root: the directory and its pages exist
    t.write([key(i) for i in range(2)], [memoryview(page(i)) for i in range(2)])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child becomes an unprivileged user and tries again
        code = 1
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            u = tier(root)
            for i in range(2):
                u.index.adopt(t.index.get(u.name(key(i))))
            result = {"refused": u.write([key(5)], [memoryview(page(5))]), "errors": dict(u.errors),
                      "intact": check_intact(u, 2)}
            try:
                tier(sys.argv[4])  # a directory this user cannot even reach
                result["unusable"] = ""
            except DiskError as exc:
                result["unusable"] = str(exc)
            os.write(write_end, json.dumps(result).encode())
            code = 0
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        raw = f.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0, f"unprivileged child failed with status {status}"
    return json.loads(raw)


def burst_runner(root):
    """A runner with 32 DRAM slots of 64 KiB writing behind to `root`, and a put helper per request."""
    import random

    from kvcr.config import load_config
    from kvcr.proto.announce import announce_request
    from kvcr.proto.keys import request_page_hashes
    from kvcr.runner import open_store

    cfg = load_config(None, {"runner.name": "fault", "runner.block_size": 4, "dram.size": 32 * PAGE,
                             "dram.pools": [{"name": "kv", "page_bytes": PAGE}], "nvme.storage_dir": root,
                             "nvme.dirty_wait_s": 0.2})
    events = []
    store = open_store(cfg, publish=events.extend)
    runner = store.runner
    requests = []

    def put(seed):
        rng = random.Random(seed)
        tokens = [rng.randrange(30000) for _ in range(16 * 4)]
        hexes, ann = request_page_hashes(tokens, 4), announce_request(tokens, 4)
        data = [rng.randbytes(PAGE) for _ in hexes]
        runner.put("kv", runner.keys("kv", hexes), data, ann)
        requests.append((hexes, data))

    return store, put, requests, events


def announced_pages_intact(store, requests):
    """Every page NVMe announces has a whole file with the bytes that were stored."""
    disk = store.lower.disks["kv"]
    stored = {h: d for hexes, data in requests for h, d in zip(hexes, data)}
    with store.runner.lock:
        names = [e.name for e in disk.index.entries()]
    for name in names:
        buf = bytearray(PAGE)
        if disk.read_into([name[:64]], [memoryview(buf)]) != 1 or bytes(buf) != stored[name[:64]]:
            return False
    return True


def burst_enospc(root):
    store, put, requests, _ = burst_runner(root)
    for seed in range(4):  # 64 pages (4 MiB) behind 32 DRAM slots, into a 1 MiB tmpfs
        put(seed)
    store.lower.persister.flush(10)
    disk, pool = store.lower.disks["kv"], store.runner.pools["kv"]
    result = {"errors": dict(disk.errors), "dropped": dict(pool.dropped), "ready": pool.statistics().num_ready,
              "on_disk": disk.index.statistics().num_pages, "intact": announced_pages_intact(store, requests),
              "tmp_left": [n for n in os.listdir(disk.dir) if n.endswith(".tmp")]}
    store.shutdown()
    return result


def burst_erofs(root):
    store, put, requests, _ = burst_runner(root)
    runner = store.runner
    put(0)
    store.lower.persister.flush(10)
    before = store.lower.disks["kv"].index.statistics().num_pages
    subprocess.run(["mount", "-o", "remount,ro", root], check=True)
    for seed in range(1, 4):
        put(seed)
    store.lower.persister.flush(10)
    pool, disk = runner.pools["kv"], store.lower.disks["kv"]
    first = requests[0]
    result = {"before": before, "errors": dict(disk.errors), "dropped": dict(pool.dropped),
              "first_request_back": runner.get("kv", runner.keys("kv", first[0])) == first[1],
              "intact": announced_pages_intact(store, requests)}
    store.shutdown()
    return result


if __name__ == "__main__":
    scenario, root, out = sys.argv[1:4]
    result = {"enospc": enospc, "erofs": erofs, "eacces": eacces, "burst_enospc": burst_enospc,
              "burst_erofs": burst_erofs}[scenario](root)
    with open(out, "w") as f:
        json.dump(result, f)
