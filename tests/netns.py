"""Test hosts: network namespaces joined by veth pairs on a bridge, each really apart.

Each host has its own network stack (`eth0`, an address on 10.77.0.0/24), its own /dev/shm
(a tmpfs in a private mount namespace), its own hostname and its own boot id (bind-mounted over
/proc/sys/kernel/random/boot_id), so neither kvcr's same-host copy nor UCX shared memory can be
chosen between them. The bridge lives in the test's own namespace with 10.77.0.254, so the test
process reaches every host as an outside client would. Needs root and iproute2.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BRIDGE = "kvcrbr0"
SUBNET = "10.77.0"
GATEWAY = f"{SUBNET}.254"
# A host's mount and UTS namespace, held open by one sleeping process: its own /dev/shm, boot id
# and name, shared by every process started on the host.
HOLD = ('mount -t tmpfs -o size=512m tmpfs /dev/shm && mount --bind "$1" /proc/sys/kernel/random/boot_id '
        '&& hostname "$2" && echo ready && exec sleep infinity')


def unavailable() -> str:
    """Why test hosts cannot be made here ("" if they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)}" if missing else ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done


@dataclass
class PacketQueue:
    """tests/nfqueue.py holding the packets one iptables match selects, in one namespace: the
    kernel's own packet queue, as this kernel has no netem. `--queue-bypass`: should the handler
    die, packets pass undelayed instead of vanishing."""

    wrap: Callable[[], list[str]]  # the prefix that runs a program in the namespace
    match: str
    stats_file: Path
    number: int
    proc: subprocess.Popen | None = None

    @property
    def chain(self) -> str:
        return f"KVCR_DELAY{self.number}"

    def _iptables(self, command: str, check: bool = True) -> None:
        subprocess.run([*self.wrap(), "sh", "-c", command], capture_output=True, text=True, check=check)

    def hold(self, ms: float, reorder_percent: float = 0, reorder_ms: float = 10) -> None:
        c = self.chain
        self._iptables(f"iptables -D INPUT -j {c}; iptables -F {c}; iptables -X {c}", check=False)
        if self.proc is not None:
            self.proc.terminate()  # it lets go of what it still holds, then writes its stats
            self.proc.wait(10)
            self.proc = None
        if not (ms or reorder_percent):
            return
        self.proc = subprocess.Popen([*self.wrap(), sys.executable, "-m", "tests.nfqueue", "--queue", str(self.number),
                                      "--delay-ms", str(ms), "--reorder-percent", str(reorder_percent),
                                      "--reorder-ms", str(reorder_ms), "--stats", str(self.stats_file)],
                                     cwd=REPO, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "bound":
            raise RuntimeError(f"packet queue {self.number} could not be bound")
        self._iptables(f"iptables -N {c} && iptables -A {c} {self.match} -j NFQUEUE --queue-num {self.number} "
                       f"--queue-bypass && iptables -I INPUT -j {c}")

    def stats(self) -> dict[str, int]:
        try:
            return json.loads(self.stats_file.read_text())
        except FileNotFoundError:
            return {"queued": 0, "released": 0, "held_back": 0, "overtaken": 0}


@dataclass
class TestHost:
    name: str
    index: int
    state_dir: Path
    holder: subprocess.Popen | None = None
    inbound: "PacketQueue" = field(init=False)
    to_gateway: "PacketQueue" = field(init=False)

    def __post_init__(self) -> None:
        self.inbound = PacketQueue(self.wrap, "-i eth0", self.state_dir / f"{self.name}.inbound.json", 0)
        self.to_gateway = PacketQueue(lambda: [], f"-i {BRIDGE} -s {self.address}",
                                      self.state_dir / f"{self.name}.to-gateway.json", 10 + self.index)

    @property
    def ns(self) -> str:
        return f"kvcr-{self.name}"

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index + 1}"

    @property
    def boot_id_file(self) -> Path:
        return self.state_dir / f"{self.name}.boot_id"

    def wrap(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["nsenter", "-t", str(self.holder.pid), "--net", "--mount", "--uts", f"--wd={REPO}", "--"]

    def sh(self, command: str, check: bool = True) -> str:
        """A shell command on this host."""
        return subprocess.run([*self.wrap(), "sh", "-c", command], capture_output=True, text=True,
                              check=check).stdout

    def kill_everything(self) -> None:
        """Every process of the host dies at once (its power cut); the host itself stays down."""
        for pid in subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True).stdout.split():
            subprocess.run(["kill", "-9", pid], capture_output=True)
        if self.holder is not None:
            self.holder.wait(5)

    def bytes_moved(self) -> tuple[int, int]:
        """(received, sent) on eth0."""
        out = self.sh("cat /sys/class/net/eth0/statistics/rx_bytes /sys/class/net/eth0/statistics/tx_bytes")
        rx, tx = map(int, out.split())
        return rx, tx

    def link(self, up: bool) -> None:
        self.sh(f"ip link set eth0 {'up' if up else 'down'}")

    def lose(self, percent: int) -> None:
        """Drop each packet this host sends or receives on eth0 with this probability (nftables'
        random numbers: real loss, which this kernel cannot make with netem); 0 lifts it."""
        self.sh("nft delete table inet kvcr_loss", check=False)
        if percent:
            rule = f"iifname eth0 numgen random mod 100 < {percent} counter drop"
            self.sh("nft add table inet kvcr_loss && "
                    "nft add chain inet kvcr_loss rx '{ type filter hook input priority 0; }' && "
                    "nft add chain inet kvcr_loss tx '{ type filter hook output priority 0; }' && "
                    f"nft add rule inet kvcr_loss rx '{rule}' && "
                    f"nft add rule inet kvcr_loss tx '{rule.replace('iifname', 'oifname')}'")

    def reset_port(self, port: int, on: bool) -> None:
        """Answer every packet to or from TCP `port` on eth0 with a reset (connections through it
        end at once, on both sides, at their next packet); `on=False` lifts it."""
        self.sh("nft delete table inet kvcr_reset", check=False)
        if on:
            self.sh("nft add table inet kvcr_reset && "
                    "nft add chain inet kvcr_reset rx '{ type filter hook input priority 0; }' && "
                    "nft add chain inet kvcr_reset tx '{ type filter hook output priority 0; }' && "
                    f"nft add rule inet kvcr_reset rx 'iifname eth0 tcp dport {port} reject with tcp reset' && "
                    f"nft add rule inet kvcr_reset tx 'oifname eth0 tcp sport {port} reject with tcp reset'")

    def delay(self, ms: float = 0, reorder_percent: float = 0, reorder_ms: float = 10) -> None:
        """Hold each packet this host receives on eth0 `ms` before the kernel takes it in, and hold
        `reorder_percent` of them `reorder_ms` longer so later ones overtake them. Delaying what a
        host receives, not what it sends, keeps TCP's small-queue limit from throttling the sender;
        delay both ends for a slow link. No arguments lift it: held packets go in at once."""
        self.inbound.hold(ms, reorder_percent, reorder_ms)

    def delay_to_gateway(self, ms: float = 0, reorder_percent: float = 0, reorder_ms: float = 10) -> None:
        """The same for what this host sends to the test's own namespace (a router run outside)."""
        self.to_gateway.hold(ms, reorder_percent, reorder_ms)

    def delayed(self) -> dict[str, int]:
        """What this host's inbound queue did so far: packets queued, released, held back, overtaken."""
        return self.inbound.stats()

    def delayed_to_gateway(self) -> dict[str, int]:
        return self.to_gateway.stats()

    def dropped(self) -> int:
        """Packets the loss rules dropped so far (0 without them)."""
        out = self.sh("nft list table inet kvcr_loss", check=False)
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", out))

    def shape(self, rate: str = "") -> None:
        """Limit what this host sends to `rate` (tc tbf, e.g. "16mbit"); "" lifts the limit."""
        self.sh("tc qdisc del dev eth0 root", check=False)
        if rate:
            self.sh(f"tc qdisc add dev eth0 root tbf rate {rate} burst 64kb latency 2s")

    def create(self) -> None:
        self.boot_id_file.write_text(str(uuid.uuid4()) + "\n")
        veth, peer = f"kv{self.index}h", f"kv{self.index}b"
        _ip("netns", "add", self.ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "master", BRIDGE, "up")
        _ip("link", "set", veth, "netns", self.ns)
        self.holder = subprocess.Popen(["ip", "netns", "exec", self.ns, "unshare", "--mount", "--uts", "--propagation",
                                        "private", "sh", "-c", HOLD, "sh", str(self.boot_id_file), self.name],
                                       stdout=subprocess.PIPE, text=True)
        if self.holder.stdout.readline().strip() != "ready":
            raise RuntimeError(f"test host {self.name}: its namespaces could not be set up")
        self.sh(f"ip link set {veth} name eth0 && ip addr add {self.address}/24 dev eth0 && ip link set eth0 up "
                f"&& ip link set lo up && ip route add default via {GATEWAY}")

    def destroy(self) -> None:
        self.to_gateway.hold(0)  # its rule is in the test's own namespace: it would outlive the host
        if self.holder is not None:
            self.inbound.hold(0)
        self.kill_everything()
        # Deleting the bridge's end takes the pair now; a dying namespace takes it only once the
        # kernel's cleanup work gets to it, and the next host made under that name would collide.
        _ip("link", "del", f"kv{self.index}b", check=False)
        _ip("netns", "del", self.ns, check=False)


LOCK_PATH = "/run/kvcr-test-hosts.lock"
_lock_fd: int | None = None


def make_hosts(n: int, state_dir: Path) -> list[TestHost]:
    """The hosts, once no other test run on this machine holds them (the names and the subnet are
    fixed, so two runs take turns)."""
    global _lock_fd
    _lock_fd = os.open(LOCK_PATH, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(_lock_fd, fcntl.LOCK_EX)
    destroy_hosts(n, release=False)  # leftovers of an interrupted run
    hosts = [TestHost(f"h{i + 1}", i, state_dir) for i in range(n)]
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for host in hosts:
            host.create()
    except BaseException:
        # The fixture never reaches its teardown: a lock kept here would stall every later test.
        for host in hosts:
            host.destroy()
        destroy_hosts(n)
        raise
    return hosts


def destroy_hosts(n: int, *, release: bool = True) -> None:
    global _lock_fd
    for i in range(n):
        TestHost(f"h{i + 1}", i, Path("/")).destroy()
    _ip("link", "del", BRIDGE, check=False)
    if release and _lock_fd is not None:
        os.close(_lock_fd)  # releases the flock
        _lock_fd = None
