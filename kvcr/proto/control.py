"""Which thread answers a control request. Pure: the socket's driver asks, and obeys.

The control thread must keep answering: a request that waits on other peers or the disk would
stall every claim behind it, and two runners pulling from each other would wait on each other.
"""

from __future__ import annotations

import enum
from typing import Container

from . import messages as m


# A claim answered with its bytes is copied where it is answered: up to this much on the control
# thread (tens of microseconds), more on a serving thread.
INLINE_ON_LOOP_BYTES = 1 << 20


class Lane(enum.Enum):
    INLINE = "inline"    # answered on the control thread: metadata only
    SLOW = "slow"        # waits on peers or the disk (our own pulls, persist)
    SERVING = "serving"  # serves a peer with copies or disk reads: never queued behind our own pulls


def lane_for(msg: m.Message, disk_pools: Container[str]) -> Lane:
    if isinstance(msg, (m.PullRequest, m.Persist)):
        return Lane.SLOW
    if isinstance(msg, m.SendPages):
        return Lane.SERVING
    if isinstance(msg, m.ClaimRequest) and (msg.digests or msg.pool in disk_pools
                                            or msg.inline_max > INLINE_ON_LOOP_BYTES):
        return Lane.SERVING  # digests read every page; an NVMe page is staged into DRAM first
    return Lane.INLINE


# What reads or writes the region, or addresses it: over a socket that authenticates nobody (a
# keyless runner's TCP control) these are refused, and info leaves out the UCX address, region
# base and rkeys. Same-host peers get them over the Unix socket (this user only, SO_PEERCRED).
REGION_REQUESTS = (m.ClaimRequest, m.Renew, m.ReleaseRequest, m.Reserve, m.Commit, m.ReserveShard,
                   m.CommitShard, m.SendPages, m.Remove)


def unauthenticated_refusal(msg: m.Message, local_path: str) -> str:
    """Why a request that came over an unauthenticated socket is refused ("" when it is not)."""
    if not isinstance(msg, REGION_REQUESTS):
        return ""
    where = f"its same-host socket {local_path}" if local_path else "no socket (runner.local_control is off)"
    return (f"{msg.TYPE} reads or writes pages: this runner has no keys, so it serves that only over {where}, "
            "to processes of its own user; give it runner.keys_dir to serve it over TCP (docs/security.md)")
