"""What the control socket answers: a decoded request and its sender in, a reply out, or an
exception naming the problem. The decisions are the runner's, its tiers' and the protocol code's;
the socket (zmq_control.py) only carries bytes and picks the thread that answers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

from ..proto import messages as m
from ..proto.announce import Announce
from ..proto.claims import MAX_LEASE_S
from ..proto.hints import parse_envelope
from ..proto.keys import StorageKey
from ..proto.page import Page
from ..proto.pull import NoPuller, PeerError

if TYPE_CHECKING:
    from ..peer_pulls import PeerPulls
    from ..runner.dram import Runner
    from ..runner.lower import LowerTier
    from ..runner.shards import ShardAssembly
    from .ucx_plane import UcxPlane

SNAPSHOT_CHUNK = 4096
MAX_PID = 1 << 22  # Linux pid_max ceiling
OFFSET_PRESENT = -1    # Reserved.offsets: the page is stored already
OFFSET_IN_FLIGHT = -2  # Reserved.offsets: another writer is storing it (it may still fail)


def _check_lease(lease_s: float) -> None:
    """0 means the runner's default; anything else must be a sane, finite duration."""
    if not (lease_s == 0 or 0 < lease_s <= MAX_LEASE_S):
        raise m.ProtocolError(f"lease_s {lease_s!r} must be 0 (default) or in (0, {MAX_LEASE_S}]")


class ControlHandlers:
    def __init__(self, runner: Runner, pulls: PeerPulls, plane: UcxPlane | None, *, lower: LowerTier,
                 shards: ShardAssembly, info: Callable[[], dict], snapshot: Callable[[], tuple[int, list]],
                 public_info: Callable[[], dict] | None = None) -> None:
        """`public_info`: info without what addresses the region (for sockets that authenticate nobody)."""
        self.runner = runner
        self.lower = lower
        self.shards = shards
        self.pulls = pulls
        self.plane = plane
        self._info = info
        self._public_info = public_info or info
        self._snapshot = snapshot
        self.incarnation = runner.incarnation  # stamped on every reply
        self.disk_pools = lower.pools  # claims on these may stage pages from disk: answered off the loop
        self.table: dict[type, Callable[[m.Message, str], m.Message]] = {
            m.InfoRequest: self._on_info, m.Lookup: self._on_lookup, m.Reserve: self._on_reserve,
            m.Commit: self._on_commit, m.ClaimRequest: self._on_claim, m.Renew: self._on_renew,
            m.ReleaseRequest: self._on_release, m.Remove: self._on_remove, m.Persist: self._on_persist,
            m.PullRequest: self._on_pull, m.PostHint: self._on_post_hint, m.SendPages: self._on_send_pages,
            m.ReserveShard: self._on_reserve_shard, m.CommitShard: self._on_commit_shard}

    def snapshot_parts(self, msg: m.SnapshotRequest) -> Iterator[m.SnapshotPart]:
        seq, events = self._snapshot()
        wire = [e.to_wire() for e in events]
        chunks = [wire[i:i + SNAPSHOT_CHUNK] for i in range(0, len(wire), SNAPSHOT_CHUNK)] or [[]]
        for i, chunk in enumerate(chunks):
            yield m.SnapshotPart(request_id=msg.request_id, incarnation=self.incarnation, seq=seq,
                                 events=chunk, done=i == len(chunks) - 1)

    def _on_info(self, msg: m.InfoRequest, owner: str) -> m.Message:
        return m.Info(info=self._info())

    def on_public_info(self, msg: m.InfoRequest, owner: str) -> m.Message:
        return m.Info(info=self._public_info())

    def _on_lookup(self, msg: m.Lookup, owner: str) -> m.Message:
        keys = self._keys(msg.pool, msg.keys)
        return m.LookupReply(num_ready=self.runner.lookup(msg.pool, keys), tiers=self.runner.tiers(msg.pool, keys))

    def _on_remove(self, msg: m.Remove, owner: str) -> m.Message:
        if msg.everything:
            return m.Removed(num_removed=self.runner.clear(msg.pool))
        return m.Removed(num_removed=self.runner.remove(msg.pool, self._keys(msg.pool, msg.keys)))

    def _on_pull(self, msg: m.PullRequest, owner: str) -> m.Message:
        try:
            num_local = self.pulls.pull_requested(msg.pool, [k.page_hex for k in self._keys(msg.pool, msg.keys)],
                                                  source=msg.source_endpoint, event_hashes=msg.event_hashes)
        except NoPuller as exc:
            raise m.ProtocolError(str(exc), code="no_ucx") from None
        except PeerError as exc:
            raise m.ProtocolError(str(exc), code="peer") from None
        return m.Pulled(num_local=num_local)

    def _on_persist(self, msg: m.Persist, owner: str) -> m.Message:
        if msg.pool not in self.lower.pools:
            raise m.ProtocolError("this runner has no NVMe tier (nvme.storage_dir is not set)", code="no_nvme")
        return m.Persisted(num_persisted=self.lower.persist(msg.pool, self._keys(msg.pool, msg.keys)))

    def _on_reserve(self, msg: m.Reserve, owner: str) -> m.Message:
        _check_lease(msg.lease_s)
        if not 0 <= msg.writer_pid <= MAX_PID:
            raise m.ProtocolError(f"reserve.writer_pid {msg.writer_pid} is not a process id")
        announces = [Announce.from_wire(a) if a is not None else None for a in msg.announces] or None
        if announces is not None and len(announces) != len(msg.keys):
            raise m.ProtocolError(f"reserve has {len(msg.keys)} keys but {len(announces)} announces")
        fill = self.runner.reserve(msg.pool, self._keys(msg.pool, msg.keys), announces, owner=owner,
                                   lease_s=msg.lease_s or None, writer_pid=msg.writer_pid)
        return m.Reserved(fill_id=fill.fill_id, offsets=self._offsets(msg.pool, fill.pages))

    def _on_reserve_shard(self, msg: m.ReserveShard, owner: str) -> m.Message:
        _check_lease(msg.lease_s)
        announces = [Announce.from_wire(a) if a is not None else None for a in msg.announces] or None
        if announces is not None and len(announces) != len(msg.keys):
            raise m.ProtocolError(f"reserve_shard has {len(msg.keys)} keys but {len(announces)} announces")
        fill, shard_offset = self.shards.reserve(msg.pool, self._keys(msg.pool, msg.keys), msg.shard, announces,
                                                 lease_s=msg.lease_s or None)
        return m.ShardReserved(fill_id=fill.fill_id, offsets=self._offsets(msg.pool, fill.pages),
                               shard_offset=shard_offset)

    def _on_commit_shard(self, msg: m.CommitShard, owner: str) -> m.Message:
        verdict = self.shards.commit(msg.fill_id, msg.shard, bool(msg.ok))
        return m.ShardCommitted(verdict="waiting" if verdict is None else "committed" if verdict else "discarded")

    def _offsets(self, pool: str, pages: list) -> list[int]:
        return [self.runner.offset(pool, p.slot) if isinstance(p, Page) else
                OFFSET_PRESENT if p is None else OFFSET_IN_FLIGHT for p in pages]

    def _on_commit(self, msg: m.Commit, owner: str) -> m.Message:
        return m.Committed(num_committed=self.runner.commit(msg.fill_id, msg.ok or None, owner=owner))

    def _on_claim(self, msg: m.ClaimRequest, owner: str) -> m.Message:
        _check_lease(msg.lease_s)
        if msg.inline_max < 0:
            raise m.ProtocolError(f"claim.inline_max {msg.inline_max} must be >= 0 (0: no bytes inline)")
        self._check_namespace(msg.pool, msg.namespace)
        registered = self.plane.registered if self.plane is not None else None
        # Bytes inline only from a runner that serves GETs: one without a data plane hands out none.
        inline_max = min(msg.inline_max, self.runner.cfg.runner.inline_pull_bytes) if self.plane is not None else 0
        grant = self.runner.grant(msg.pool, self._keys(msg.pool, msg.keys), owner=owner, lease_s=msg.lease_s or None,
                                  digests=msg.digests, registered=registered, inline_max=inline_max)
        return grant.reply

    def _check_namespace(self, pool: str, theirs: dict) -> None:
        """Same page hash, other namespace = other bytes: refuse, naming both values."""
        if not theirs:
            return
        mine = self.runner.layouts[self.runner.pool(pool).name].namespace.fields()
        diff = [f"{k}: ours {mine[k]!r}, yours {theirs.get(k)!r}" for k in mine if theirs.get(k) != mine[k]]
        if diff:
            raise m.ProtocolError(f"namespace mismatch on pool {pool!r}: " + "; ".join(diff), code="namespace")

    def _on_renew(self, msg: m.Renew, owner: str) -> m.Message:
        return self.runner.renew(msg.claim_id, owner=owner)

    def _on_release(self, msg: m.ReleaseRequest, owner: str) -> m.Message:
        return self.runner.release(msg.claim_id, owner=owner, drop=msg.drop).reply

    def _on_send_pages(self, msg: m.SendPages, owner: str) -> m.Message:
        """Two-sided fallback: send claimed pages, and nothing else, to the puller's worker."""
        plane = self.plane
        if plane is None:
            raise m.ProtocolError("this runner has no UCX data plane (runner.ucx = false)", code="no_ucx")
        try:
            address = bytes.fromhex(msg.address)
        except ValueError:
            raise m.ProtocolError("send_pages.address is not a hex UCX worker address") from None
        # Our own pin on the claim's pages: its lease may end while the sends run, the pin may not.
        pinned = self.runner.pin_claimed(msg.claim_id, owner, [(o, n) for o, n, _ in msg.ops])
        if pinned is None:
            raise m.ProtocolError(f"send_pages asks for bytes outside claim {msg.claim_id}", code="claim")
        base = self.runner.region_address
        done = plane.send_tagged(address, [(base + o, n, tag) for o, n, tag in msg.ops],
                                 timeout_s=self.runner.cfg.runner.pull_timeout_s)
        if all(done):  # a send still running may read these slots: then they stay pinned for good
            self.runner.unpin(*pinned)
        return m.Sent(done=done)

    def _on_post_hint(self, msg: m.PostHint, owner: str) -> m.Message:
        hint = parse_envelope(msg.envelope, allow_move=True)  # HintError names the problem
        self.pulls.post_hint(hint)
        return m.HintPosted(num_hashes=len(hint.block_hashes))

    def _keys(self, pool: str, page_hexes: list[str]) -> list[StorageKey]:
        self.runner.pool(pool)
        return self.runner.keys(pool, page_hexes)
