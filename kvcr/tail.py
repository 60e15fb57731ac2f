"""`kvcr events tail`: events as JSON lines on stdout, notices (gaps, replays) on stderr."""

from __future__ import annotations

import json
import sys
import time

from .proto.events import BlockStored


def tail(endpoint: str, replay: str | None, *, count: int = 0, timeout_s: float = 0.0,
         from_snapshot: str | None = None, out=sys.stdout) -> int:
    from .config import CurveKeys
    from .drivers.zmq_subscriber import Delivery, Subscriber

    lost = []
    sub = Subscriber(on_unrepaired=lost.append)
    sub.add("runner", endpoint, replay, CurveKeys.from_env())  # the runner's keys speak CURVE on events too

    def snapshot() -> int:
        """Print the whole inventory (a consumer replaces its state with it); returns its seq."""
        from .client import ControlClient

        with ControlClient(from_snapshot) as client:
            seq, events = client.snapshot()
        out.write(json.dumps({"seq": seq, "snapshot": "begin"}) + "\n")
        for event in events:
            out.write(json.dumps({"seq": seq, "snapshot": True, "event": event.to_wire()}) + "\n")
        out.write(json.dumps({"seq": seq, "snapshot": "end"}) + "\n")
        return seq

    if from_snapshot:
        sub.start_after("runner", snapshot())
    deadline = time.monotonic() + timeout_s if timeout_s else None
    stored = 0
    try:
        while deadline is None or time.monotonic() < deadline:
            for item in sub.poll(200):
                if not isinstance(item, Delivery):
                    print(f"kvcr events tail: {item.kind}: {item.detail}", file=sys.stderr)
                    if lost and from_snapshot:  # replay could not repair a gap: resync
                        lost.clear()
                        snapshot()
                    continue
                for event in item.batch.events:
                    out.write(json.dumps({"seq": item.seq, "ts": item.batch.ts, "dp_rank": item.batch.dp_rank,
                                          "replayed": item.replayed, "event": event.to_wire()}) + "\n")
                    if isinstance(event, BlockStored):
                        stored += len(event.block_hashes)
                out.flush()
            if count and stored >= count:
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        sub.close()
    return 0 if not count else 1
