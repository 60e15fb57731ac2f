"""Live test 4, a source killed in the middle of the transfer: B's UCX GETs from A cross loopback
over TCP, slowed by a tc token bucket that only A's and B's UCX ports pass through, and A is
SIGKILLed once part of the pages went across. B answers as A would have (recomputing what did not
arrive), keeps only whole pages, and pulls again from the restarted A. Root only (tc)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from contextlib import contextmanager

import pytest

from kvcr.proto.hints import build_envelope
from sglang_adapter.cpu_harness.model import prompt_text
from tests.helpers import wait_until
from tests.sglang_live.helpers import metric

pytestmark = [pytest.mark.live_sglang,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="tc on lo needs root")]
PAGE = 16
WAIT = ["--hicache-storage-prefetch-policy", "wait_complete"]
# UCX listens in these ranges (below the harness's 30000-32699 and Linux's ephemeral ports), so
# one u32 match (32704/0xffe0 = 32704-32735) catches both directions of every A-B connection.
UCX_PORTS = {"A": "32704-32719", "B": "32720-32735"}
FIRST, MASK = 32704, 0xffe0
RATE = "800kbit"  # 100 KB/s: a 2000-token prompt (125 pages of 4 KiB) takes about 5 s


def ucx_env(name: str) -> dict:
    # small socket buffers: what A has not sent yet stays in A and dies with it (a kernel buffer
    # of megabytes would go on delivering after the kill)
    return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_TCP_PORT_RANGE": UCX_PORTS[name],
            "UCX_TCP_SNDBUF": "16kb", "UCX_TCP_RCVBUF": "16kb"}


def tc(*args: str, check: bool = True) -> str:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=check).stdout


@contextmanager
def shaped_ucx_ports():
    """An HTB qdisc on lo whose one class, rate-limited, takes only the UCX ports above; all other
    traffic is unclassified and passes unshaped. (This kernel has neither prio nor netem.)"""
    tc("qdisc", "del", "dev", "lo", "root", check=False)
    tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb")
    tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:30", "htb", "rate", RATE, "ceil", RATE,
       "burst", "16kb", "cburst", "16kb")
    for side in ("sport", "dport"):
        tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
           "match", "ip", side, str(FIRST), hex(MASK), "flowid", "1:30")
    try:
        yield
    finally:
        tc("qdisc", "del", "dev", "lo", "root", check=False)


def shaped_bytes() -> int:
    found = re.search(r"class htb 1:30 .*?Sent (\d+) bytes", tc("-s", "class", "show", "dev", "lo"), re.S)
    return int(found.group(1)) if found else 0


@pytest.fixture(scope="module")
def pair(engines):
    (a,) = engines("kill-A", args=WAIT, env=ucx_env("A"))
    # GETs, not the bytes in the claim's answer (the tiny model's pulls are small enough): the kill lands mid-GET
    (b,) = engines("kill-B", args=WAIT, env=ucx_env("B"),
                   runner={"runner.transfer": "get", "runner.inline_pull_bytes": 0})
    return a, b


def test_a_source_killed_mid_transfer_leaves_the_puller_answering_with_whole_pages_only(pair, live):
    a, b = pair
    text = prompt_text(800, 2000)
    at_a = live.serve(a, text, timeout_s=60)
    full = at_a["meta_info"]["prompt_tokens"] // PAGE
    envelope = build_envelope(a.endpoints["control"], a.stored_hashes())
    result: dict = {}
    with shaped_ucx_ports():
        asking = threading.Thread(target=lambda: result.update(live.generate(b, text, kv_hints=envelope)))
        asking.start()
        # part of the pages went across (only UCX is shaped, not the control messages)
        wait_until(lambda: shaped_bytes() > 100_000, timeout_s=60, interval_s=0.05, message="the GETs under way")
        a.stop(signal.SIGKILL)
        asking.join(120)
    assert result, "B did not answer"
    # the pages that arrived before the kill count, what did not arrive was recomputed
    assert 0 < result["meta_info"]["cached_tokens"] < full * PAGE
    assert result["output_ids"] == at_a["output_ids"]
    assert live.logprobs(result) == live.logprobs(at_a)
    assert b.proc.poll() is None
    assert metric(b.runner_get("/metrics"), "kvcr_pages", state="quarantined") == 0
    # whatever B kept (pulled whole, or backed up from its recompute) reads back exact
    live.flush(b)
    local = live.generate(b, text)
    assert local["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert live.logprobs(local) == live.logprobs(at_a)
    # and the restarted A serves B again
    a.start().wait_ready()
    live.pulls_again(a, b, prompt_text(801, 400))
