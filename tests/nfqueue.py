"""Delay and reorder a test host's packets in the kernel's own queue (netfilter's NFQUEUE).

This machine's kernel has no `sch_netem`, but it has NFQUEUE: iptables hands each packet on
`eth0` to this process, which holds it and gives the kernel its verdict later. A packet is
released `delay_ms` after it was queued; `reorder_percent` of the packets, spread evenly, are
held `reorder_ms` longer, so the packets behind them overtake them. TCP, ZMQ and UCX see real late and
out-of-order segments. Run inside the host's network namespace:

    python -m tests.nfqueue --queue 0 --delay-ms 40 --reorder-percent 20 --stats FILE

The stats file (JSON, rewritten at most every 0.1 s and on exit) counts packets queued,
released and overtaken. The netlink protocol is nfnetlink_queue's (linux/netfilter/nfnetlink_queue.h).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import select
import signal
import socket
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG = (NFNL_SUBSYS_QUEUE << 8) | 0, (NFNL_SUBSYS_QUEUE << 8) | 1, (NFNL_SUBSYS_QUEUE << 8) | 2
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND = 1
COPY_META = 1
F_GSO = 1 << 2  # take GSO packets whole: a verdict per super-packet, not per segment
ATTR_PACKET_HDR, ATTR_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_GENMSG = struct.Struct("!BBH")  # nfgenmsg: family, version, res_id (the queue number)
_ATTR = struct.Struct("=HH")


def _attr(kind: int, payload: bytes) -> bytes:
    size = _ATTR.size + len(payload)
    return _ATTR.pack(size, kind) + payload + b"\0" * (-size % 4)


def _message(kind: int, flags: int, seq: int, queue: int, attrs: bytes) -> bytes:
    body = _GENMSG.pack(socket.AF_UNSPEC, 0, queue) + attrs
    return _HEADER.pack(_HEADER.size + len(body), kind, flags, seq, 0) + body


def _packet_id(data: bytes, start: int, end: int) -> int | None:
    at = start + _HEADER.size + _GENMSG.size
    while at + _ATTR.size <= end:
        size, kind = _ATTR.unpack_from(data, at)
        if size < _ATTR.size:
            return None
        if kind & 0x7FFF == ATTR_PACKET_HDR:
            return struct.unpack_from("!I", data, at + _ATTR.size)[0]
        at += size + (-size % 4)
    return None


@dataclass
class Stats:
    queued: int = 0
    released: int = 0
    held_back: int = 0  # packets chosen to be overtaken
    overtaken: int = 0  # packets released after one queued later than them


class DelayQueue:
    """The schedule, without I/O: which packet ids are due at `now`."""

    def __init__(self, delay_s: float, reorder_percent: float, reorder_s: float) -> None:
        self.delay_s, self.reorder_p, self.reorder_s = delay_s, reorder_percent / 100, reorder_s
        self.credit = 0.0  # held back evenly, not at random: a short exchange gets its share too
        self.heap: list[tuple[float, int, int]] = []  # (due, arrival order, packet id)
        self.arrivals = 0
        self.latest_released = -1
        self.stats = Stats()

    def queue(self, packet_id: int, now: float) -> None:
        due = now + self.delay_s
        self.credit += self.reorder_p
        if self.credit >= 1.0:
            self.credit -= 1.0
            due += self.reorder_s
            self.stats.held_back += 1
        heapq.heappush(self.heap, (due, self.arrivals, packet_id))
        self.arrivals += 1
        self.stats.queued += 1

    def due(self, now: float) -> list[int]:
        ready = []
        while self.heap and self.heap[0][0] <= now:
            _, order, packet_id = heapq.heappop(self.heap)
            if order < self.latest_released:
                self.stats.overtaken += 1
            self.latest_released = max(self.latest_released, order)
            ready.append(packet_id)
        self.stats.released += len(ready)
        return ready

    def next_due(self) -> float | None:
        return self.heap[0][0] if self.heap else None


class Handler:
    """Binds one queue and releases its packets on the schedule."""

    def __init__(self, queue_num: int, schedule: DelayQueue, stats_file: Path | None) -> None:
        self.queue_num, self.schedule, self.stats_file = queue_num, schedule, stats_file
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE: root may exceed rmem_max
        self.sock.bind((0, 0))
        self.seq = 0
        self.stopping = False
        self.written_at = 0.0

    def _request(self, attrs: bytes) -> None:
        self.seq += 1
        self.sock.send(_message(MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, self.seq, self.queue_num, attrs))
        reply = self.sock.recv(65536)
        _, kind, _, _, _ = _HEADER.unpack_from(reply)
        errno = struct.unpack_from("=i", reply, _HEADER.size)[0] if kind == NLMSG_ERROR else 0
        if errno:
            raise OSError(-errno, f"nfnetlink_queue refused queue {self.queue_num}'s configuration: "
                                  f"{os.strerror(-errno)}")

    def bind(self) -> None:
        self._request(_attr(CFG_CMD, struct.pack("!BxH", CMD_BIND, socket.AF_INET)))
        self._request(_attr(CFG_PARAMS, struct.pack("!IB", 0, COPY_META))
                      + _attr(CFG_QUEUE_MAXLEN, struct.pack("!I", 1 << 16))
                      + _attr(CFG_MASK, struct.pack("!I", F_GSO)) + _attr(CFG_FLAGS, struct.pack("!I", F_GSO)))

    def _receive(self, now: float) -> None:
        for _ in range(1024):  # one packet a datagram: take what is waiting, then release what is due
            try:
                self._parse(self.sock.recv(1 << 16, socket.MSG_DONTWAIT), now)
            except BlockingIOError:
                return
            except OSError:  # ENOBUFS: the kernel dropped what it could not hand over (packet loss)
                continue

    def _parse(self, data: bytes, now: float) -> None:
        at = 0
        while at + _HEADER.size <= len(data):
            size, kind, _, _, _ = _HEADER.unpack_from(data, at)
            if size < _HEADER.size:
                break
            packet_id = _packet_id(data, at, at + size) if kind == MSG_PACKET else None
            if packet_id is not None:
                self.schedule.queue(packet_id, now)
            at += size + (-size % 4)

    def _release(self, now: float) -> None:
        ids = self.schedule.due(now)
        for start in range(0, len(ids), 256):
            self.sock.send(b"".join(
                _message(MSG_VERDICT, NLM_F_REQUEST, 0, self.queue_num,
                         _attr(ATTR_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id)))
                for packet_id in ids[start:start + 256]))

    def _write_stats(self, now: float, force: bool = False) -> None:
        if self.stats_file is None or not (force or now - self.written_at >= 0.1):
            return
        self.written_at = now
        temporary = self.stats_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(self.schedule.stats)))
        temporary.replace(self.stats_file)

    def run(self) -> None:
        while not self.stopping:
            now = time.monotonic()
            due = self.schedule.next_due()
            wait = 0.1 if due is None else min(0.1, max(0.0, due - now))
            try:
                select.select([self.sock], [], [], wait)
            except InterruptedError:
                pass
            now = time.monotonic()
            self._receive(now)
            self._release(now)
            self._write_stats(now)
        # What is still held goes out now: the rules stay until the caller removes them.
        self.schedule.delay_s = 0.0
        self._release(float("inf"))
        self._write_stats(time.monotonic(), force=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--reorder-percent", type=float, default=0.0)
    parser.add_argument("--reorder-ms", type=float, default=10.0, help="how much longer a held-back packet waits")
    parser.add_argument("--stats", type=Path)
    args = parser.parse_args(argv)
    handler = Handler(args.queue, DelayQueue(args.delay_ms / 1000, args.reorder_percent, args.reorder_ms / 1000),
                      args.stats)
    handler.bind()

    def stop(*_: object) -> None:
        handler.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("bound", flush=True)
    handler.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
