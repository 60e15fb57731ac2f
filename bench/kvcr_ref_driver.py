"""Runs inside the separate NVIDIA kvcr 0.1.1 environment (see bench/vs_nvidia_kvcr.py).

    python kvcr_ref_driver.py PAGES PAGE_BYTES ITERATIONS

Two KVCR instances in this process (as the reference measured them): A deposits the pages, B
receives a router hint naming A and `deliver`s them into its framework memory over NIXL/UCX.
Prints one JSON line: per-iteration seconds (hint + deliver + completion), bytes checked.
"""

import ctypes
import json
import mmap
import socket
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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def buffer(size):
    mm = mmap.mmap(-1, size)
    return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))


def instance(name, pages, page_bytes):
    fw, fw_addr = buffer(pages * page_bytes)
    pool, pool_addr = buffer(2 * pages * page_bytes)
    control = ZmqPeerControlChannel("127.0.0.1", free_port(), "127.0.0.1")
    pin = NothingPinned()
    kv = KVCR(KVCRConfig(nixl_agent_name=name, pool_layouts=[("", page_bytes)], nixl_listen_port=0,
                         operation_timeout_ms=5000, abandon_timeout_ms=10000),
              KVCRBindings(pin.request_pin, pin.poll_pin_results, pin.release_pin, framework_control=control,
                           key_adapter=RouterKeys(), inventory_sink=lambda event: None),
              KVCRBackendConfigs(framework_regions=[RegionDescriptor(addr=fw_addr, size=page_bytes, count=pages,
                                                                     label="")],
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


def main():
    pages, page_bytes, iterations = map(int, sys.argv[1:4])
    a, a_fw, a_ctl, a_keep = instance("A", pages, page_bytes)
    b, b_fw, _, b_keep = instance("B", pages, page_bytes)
    payload = bytes(range(256)) * (pages * page_bytes // 256)
    a_fw[:] = payload
    keys = [BlockKey(i.to_bytes(8, "big") + b"#blk") for i in range(1, pages + 1)]
    op = a.deposit({k: [MemoryRef(end_point_name="A", label="", element_index=i)] for i, k in enumerate(keys)})
    assert all(r.success for r in wait([a, b], op, a).values())
    times = []
    for _ in range(iterations + 1):  # the first one includes the metadata handshake: dropped
        b_fw[:] = b"\0" * len(b_fw)
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        b.submit_hint({"protocol_version": "0.1", "message_id": rid, "actions": [{
            "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
            "payload": {"source_control_endpoint": a_ctl.endpoint,
                        "block_hashes": [int.from_bytes(k[:8], "big") for k in keys]}}]}, request_id=rid)
        op = b.deliver({k: [MemoryRef(end_point_name="B", label="", element_index=i)] for i, k in enumerate(keys)},
                       request_id=rid)
        results = wait([a, b], op, b)
        times.append(time.perf_counter() - t0)
        b.discard_hint(rid)
        assert all(r.success for r in results.values()) and b_fw[:] == payload, "kvcr delivered wrong bytes"
    b.close()
    a.close()
    print(json.dumps({"seconds": times[1:]}))


if __name__ == "__main__":
    main()
