"""Runs inside the separate NVIDIA kvcr 0.1.1 environment (see bench/vs_nvidia_kvcr.py).

    python kvcr_ref_driver.py PAGES PAGE_BYTES ITERATIONS [PROCESSES]

Two KVCR instances: A deposits the pages, B receives a router hint naming A and `deliver`s them
into its framework memory over NIXL/UCX. PROCESSES = 1 keeps both in this process (as the
reference measured them); 2 runs A in a child process of its own, as a real source would be.
Prints one JSON line: per-iteration seconds (hint + deliver + completion), bytes checked.
"""

import ctypes
import json
import mmap
import os
import socket
import subprocess
import sys
import time
import uuid

from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.types import BlockKey, MemoryRef, RegionDescriptor

from kvcr import KVCR, KVCRBindings
from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions, RemoteFWDramOptions


class NothingPinned:
    """kvcr asks the framework to pin pages; this benchmark's framework memory needs none."""

    def __init__(self):
        self.next_id, self.results = 0, []

    def request_pin(self, keys):
        self.next_id += 1
        self.results.append((self.next_id, None))
        return self.next_id

    def poll_pin_results(self):
        out, self.results = self.results, []
        return out

    def release_pin(self, handle):
        return True


class RouterKeys:
    def encode(self, key):
        return key

    def decode(self, key):
        return int.from_bytes(key[:8], "big")


ROTATION = 4  # destination copies used in turn (kvcr's side of the bench does the same)
LIBC = ctypes.CDLL(None)
LIBC.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def buffer(size):
    mm = mmap.mmap(-1, size)
    return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))


def instance(name, pages, page_bytes, copies=1):
    fw, fw_addr = buffer(copies * pages * page_bytes)
    pool, pool_addr = buffer(2 * pages * page_bytes)
    control = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
    pin = NothingPinned()
    region = RegionDescriptor(addr=fw_addr, size=page_bytes, count=copies * pages, label="")
    kv = KVCR(KVCRConfig(nixl_agent_name=name, pool_layouts=[("", page_bytes)], nixl_listen_port=0,
                         operation_timeout_ms=5000, abandon_timeout_ms=10000),
              KVCRBindings(pin.request_pin, pin.poll_pin_results, pin.release_pin, framework_control=control,
                           key_adapter=RouterKeys(), inventory_sink=lambda event: None),
              KVCRBackendConfigs(framework_regions=[region],
                                 local_dram=LocalDramOptions([("", pool_addr, 2 * pages * page_bytes)], "UCX"),
                                 remote_fw_dram=RemoteFWDramOptions(eager_ctrl_connect=True)))
    return kv, fw, control, (pin, pool)


def wait(instances, op, owner):
    while True:
        for kv in instances:
            for handle, results in kv.poll_completed():
                if kv is owner and handle == op:
                    return results
        time.sleep(0.0001)


def deposit(a, pages, page_bytes, a_fw, keys, polled):
    a_fw[:] = payload_of(pages, page_bytes)
    op = a.deposit({k: [MemoryRef(end_point_name="A", label="", element_index=i)] for i, k in enumerate(keys)})
    assert all(r.success for r in wait(polled, op, a).values())


def payload_of(pages, page_bytes):
    return bytes(range(256)) * (pages * page_bytes // 256)


def keys_of(pages):
    return [BlockKey(i.to_bytes(8, "big") + b"#blk") for i in range(1, pages + 1)]


def serve_source(pages, page_bytes):
    """The child of a two-process run: instance A, driven until its parent closes our stdin."""
    import os
    import threading

    a, a_fw, a_ctl, _keep = instance("A", pages, page_bytes)
    deposit(a, pages, page_bytes, a_fw, keys_of(pages), [a])
    print(json.dumps({"endpoint": a_ctl.endpoint}), flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while not done.is_set():
        a.poll_completed()
        time.sleep(0.0001)
    a.close()
    os._exit(0)


def start_source(pages, page_bytes):
    child = subprocess.Popen([sys.executable, __file__, "source", str(pages), str(page_bytes)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in child.stdout:  # NIXL logs to stdout too
        if line.startswith('{"endpoint"'):
            return child, json.loads(line)["endpoint"]
    raise RuntimeError(f"the source process exited ({child.wait()}) before serving")


def main():
    if sys.argv[1] == "source":
        serve_source(int(sys.argv[2]), int(sys.argv[3]))
    pages, page_bytes, iterations = map(int, sys.argv[1:4])
    processes = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    keys, payload = keys_of(pages), payload_of(pages, page_bytes)
    child = None
    b, b_fw, _, b_keep = instance("B", pages, page_bytes, ROTATION)
    if processes == 1:
        a, a_fw, a_ctl, a_keep = instance("A", pages, page_bytes)
        deposit(a, pages, page_bytes, a_fw, keys, [a, b])
        polled, endpoint = [a, b], a_ctl.endpoint
    else:
        child, endpoint = start_source(pages, page_bytes)
        polled = [b]
    expected = ctypes.create_string_buffer(payload, len(payload))
    fw_base = ctypes.addressof(ctypes.c_char.from_buffer(b_fw))
    ctypes.memset(fw_base, 0, len(b_fw))
    times = []
    for it in range(iterations + 1):  # the first one includes the metadata handshake: dropped
        first = it % ROTATION * pages  # a destination not written just before, as in a serving engine
        fw_addr = fw_base + first * page_bytes
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        b.submit_hint({"protocol_version": "0.1", "message_id": rid, "actions": [{
            "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
            "payload": {"source_control_endpoint": endpoint,
                        "block_hashes": [int.from_bytes(k[:8], "big") for k in keys]}}]}, request_id=rid)
        op = b.deliver({k: [MemoryRef(end_point_name="B", label="", element_index=first + i)]
                        for i, k in enumerate(keys)}, request_id=rid)
        results = wait(polled, op, b)
        times.append(time.perf_counter() - t0)
        b.discard_hint(rid)
        assert all(r.success for r in results.values()), "kvcr reported failed keys"
        assert LIBC.memcmp(fw_addr, expected, len(payload)) == 0, "kvcr delivered wrong bytes"
        ctypes.memset(fw_addr, 0, len(payload))  # ready for its next turn; nothing allocated
    b.close()
    if child is None:
        a.close()
    else:
        child.stdin.close()
        child.wait(30)
    print(json.dumps({"seconds": times[1:]}))
    sys.stdout.flush()
    os._exit(0)  # NIXL's threads can crash an orderly interpreter exit after the work is done


if __name__ == "__main__":
    main()
