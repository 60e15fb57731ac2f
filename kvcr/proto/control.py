"""Which thread answers a control request. Pure: the socket's driver asks, and obeys.

The control thread must keep answering: a request that waits on other peers or the disk would
stall every claim behind it, and two runners pulling from each other would wait on each other.
"""

from __future__ import annotations

import enum
from typing import Container

from . import messages as m


class Lane(enum.Enum):
    INLINE = "inline"    # answered on the control thread: metadata only
    SLOW = "slow"        # waits on peers or the disk (our own pulls, persist)
    SERVING = "serving"  # serves a peer with copies or disk reads: never queued behind our own pulls


def lane_for(msg: m.Message, disk_pools: Container[str]) -> Lane:
    if isinstance(msg, (m.Pull, m.Persist)):
        return Lane.SLOW
    if isinstance(msg, m.SendPages):
        return Lane.SERVING
    if isinstance(msg, m.ClaimRequest) and (msg.digests or msg.pool in disk_pools):
        return Lane.SERVING  # digests read every page; an NVMe page is staged into DRAM first
    return Lane.INLINE
