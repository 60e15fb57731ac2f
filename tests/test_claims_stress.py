"""No claim ever leaks: a hypothesis state machine and a seeded multi-thread stress on a real runner."""

import random
import threading

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcr.config import load_config
from kvcr.proto.announce import announce_request
from kvcr.proto.claims import ClaimError, ClaimLimit, ClaimTable
from kvcr.proto.keys import request_page_hashes
from kvcr.proto.pool import PagePool, PoolExhausted
from kvcr.runner import Runner

BLOCK = 2
PREFIXES = [list(range(i * 100, i * 100 + 6 * BLOCK)) for i in range(6)]
CHAINS = [(request_page_hashes(t, BLOCK), announce_request(t, BLOCK)) for t in PREFIXES]


def accounting_holds(pool: PagePool) -> bool:
    s = pool.statistics()
    return s.num_free + s.num_ready + s.num_filling + s.num_discarding + s.num_quarantined == s.capacity


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = PagePool("kv", page_bytes=8, num_slots=10, block_size=BLOCK, high_watermark=0.9,
                             low_watermark=0.7)
        self.table = ClaimTable(max_claim_fraction=0.6)
        self.now = 0.0
        self.claims: list[tuple[int, str]] = []
        self.fills: list[tuple[int, str]] = []

    @rule(c=st.integers(0, 5), n=st.integers(1, 6))
    def store(self, c, n):
        keys, ann = CHAINS[c]
        try:
            self.pool.commit_fill(self.pool.begin_fill(keys[:n], ann[:n]))
        except PoolExhausted:
            pass

    @rule(c=st.integers(0, 5), n=st.integers(1, 6), owner=st.sampled_from("abc"), lease=st.floats(0.1, 3))
    def reserve(self, c, n, owner, lease):
        keys, ann = CHAINS[c]
        try:
            fill = self.table.reserve(self.pool, keys[:n], ann[:n], owner=owner, lease_s=lease, now=self.now)
            self.fills.append((fill.fill_id, owner))
        except PoolExhausted:
            pass

    @precondition(lambda self: self.fills)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def commit_or_abort(self, i, ok):
        fill_id, owner = self.fills.pop(i % len(self.fills))
        try:
            self.table.commit(fill_id, owner=owner, ok=None, abort=not ok)
        except ClaimError:
            pass  # expired meanwhile

    @rule(c=st.integers(0, 5), owner=st.sampled_from("abc"), lease=st.floats(0.1, 3))
    def claim(self, c, owner, lease):
        try:
            claim = self.table.claim(self.pool, CHAINS[c][0], owner=owner, lease_s=lease, now=self.now)
        except ClaimLimit:
            return
        if claim.pages:
            self.claims.append((claim.claim_id, owner))

    @precondition(lambda self: self.claims)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        claim_id, owner = self.claims.pop(i % len(self.claims))
        try:
            self.table.release(claim_id, owner=owner)
        except ClaimError:
            pass

    @rule(c=st.integers(0, 5))
    def remove(self, c):
        self.pool.remove(CHAINS[c][0])

    @rule()
    def clear(self):
        self.pool.clear()

    @rule(dt=st.floats(0.0, 2.0))
    def tick(self, dt):
        self.now += dt
        self.table.expire(self.now)

    @invariant()
    def accounting(self):
        assert accounting_holds(self.pool)
        assert self.pool.num_claimed <= int(self.pool.capacity * 0.6)

    def teardown(self):
        self.now += 1000
        self.table.expire(self.now)
        stats = self.pool.statistics()
        assert self.table.statistics().num_claims == 0 and self.table.statistics().num_fills == 0
        assert stats.num_claimed == 0 and stats.num_discarding == 0 and stats.num_filling == 0
        assert stats.num_free + stats.num_ready == stats.capacity


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_seeded_threaded_stress_leaves_no_claim_and_exact_accounting():
    clock = [0.0]
    cfg = load_config(None, {"runner.name": "stress", "runner.block_size": BLOCK, "dram.size": "1Mi",
                             "dram.pools": [{"name": "kv", "page_bytes": 4096}], "dram.max_claim_fraction": 0.5,
                             "dram.high_watermark": 0.95, "dram.low_watermark": 0.8})
    events = []
    runner = Runner(cfg, publish=events.append, clock=lambda: clock[0])
    pool_name = "kv"
    key_chains = [[runner.key(pool_name, k) for k in CHAINS[c][0]] for c in range(6)]
    errors = []
    counts = {"ops": 0}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(2500):
                c = rng.randrange(6)
                keys, ann = key_chains[c], CHAINS[c][1]
                op = rng.random()
                if op < 0.35:
                    n = rng.randint(1, 6)
                    payload = [bytes([seed]) * 4096] * n
                    try:
                        runner.put(pool_name, keys[:n], payload, ann[:n])
                    except PoolExhausted:
                        pass
                elif op < 0.7:
                    try:
                        claim = runner.claim(pool_name, keys, owner=f"t{seed}", lease_s=rng.uniform(0.1, 2))
                    except ClaimLimit:
                        continue
                    fate = rng.random()
                    if claim.pages and fate < 0.6:
                        try:
                            runner.release(claim.claim_id, owner=f"t{seed}")
                        except ClaimError:
                            pass  # its lease ran out first (another thread moved the clock)
                    # else: abandoned (a cancelled or dead caller): only the lease ends it
                elif op < 0.8:
                    fill = runner.reserve(pool_name, keys[:3], ann[:3], owner=f"t{seed}", lease_s=0.5)
                    if rng.random() < 0.5:
                        try:
                            runner.commit(fill.fill_id, [rng.random() < 0.5 for _ in fill.pages],
                                          owner=f"t{seed}")
                        except ClaimError:
                            pass  # expired: its slots were already freed
                elif op < 0.9:
                    runner.remove(pool_name, keys[:rng.randint(1, 6)])
                else:
                    with lock:
                        clock[0] += rng.uniform(0, 0.5)
                    runner.expire()
                with lock:
                    counts["ops"] += 1
        except PoolExhausted:
            pass
        except Exception as exc:  # surfaced below with the seed
            errors.append((seed, repr(exc)))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert counts["ops"] >= 10_000
    clock[0] += 1000
    runner.expire()
    stats = runner.pools[pool_name].statistics()
    assert runner.claims.statistics().num_claims == 0 and runner.claims.statistics().num_fills == 0
    assert stats.num_claimed == 0 and stats.num_filling == 0 and stats.num_discarding == 0
    assert stats.num_free + stats.num_ready == stats.capacity
    assert runner.claims.num_expired_claims > 0
    runner.shutdown()
