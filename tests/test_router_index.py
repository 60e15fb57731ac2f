"""The router's inventory index and cost model, against Dynamo's own indexer on the same events."""

import dataclasses
import itertools
import random
import time

import pytest

from kvcr.drivers.zmq_events import EventPublisher, SeqSource
from kvcr.proto.announce import announce_request
from kvcr.proto.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcr.proto.hints import parse_envelope
from kvcr.proto.keys import to_u64
from kvcr.proto.pool import coalesce_announces
from router_hints.index import InventoryIndex, Overlap
from router_hints.scoring import CostModel, Load, choose, choose_source, cost
from tests.helpers import wait_until

BLOCK = 16


def stored(tokens, first, n, medium, lora=None, salt=None):
    ann = announce_request(tokens, BLOCK, cache_salt=salt, lora_name=lora)[first:first + n]
    (event,) = coalesce_announces(ann, BLOCK, medium)  # the runner's own path: one event per chain run
    return event, ann


def batch(*events, dp_rank=0):
    return EventBatch(ts=0.0, events=events, dp_rank=dp_rank)


def tokens_for(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n * BLOCK)]


def test_tier_continuation_matches_dynamo_semantics():
    index = InventoryIndex(block_size=BLOCK)
    t = tokens_for(1, 6)
    for first, n, medium in ((0, 2, "GPU"), (2, 1, "CPU_PINNED"), (3, 1, "CPU_TIER1"), (4, 1, "DISK"),
                             (5, 1, "EXTERNAL")):
        index.apply("w1", batch(stored(t, first, n, medium)[0]))
    o = index.overlaps(index.sequence_hashes(t))[("w1", 0)]
    # Dynamo (CPU_TIER1 is its host tier): gpu 32, cpu 64, disk 96 tokens; the runner lacks block 0
    assert o == Overlap(device=2, host=1, dram=1, disk=2, runner=0) and o.depth == 6


ONE_BLOCK = {"device": Overlap(device=1), "host": Overlap(host=1), "dram": Overlap(dram=1, runner=1),
             "disk": Overlap(disk=1, runner=1), "shared": Overlap(disk=1)}


@pytest.mark.parametrize("medium, tier", [
    (None, "device"), ("GPU", "device"), ("DEVICE", "device"),
    ("CPU", "host"), ("CPU_PINNED", "host"),  # the engine's host pool: its runner cannot serve it
    ("CPU_TIER1", "dram"),                    # a runner's DRAM
    ("CPU_TIER2", "disk"), ("DISK", "disk"), ("NVME", "disk"), ("STORAGE", "disk"),
    ("EXTERNAL", "shared"), ("SHARED", "shared"), ("REMOTE", "shared"), ("NETWORK", "shared"),
])
def test_each_medium_lands_in_its_tier_and_only_runner_media_count_for_the_runner(medium, tier):
    index = InventoryIndex(block_size=BLOCK)
    t = tokens_for(11, 1)
    event = dataclasses.replace(stored(t, 0, 1, "GPU")[0], medium=medium)
    index.apply("w1", batch(event))
    assert index.overlaps(index.sequence_hashes(t)) == {("w1", 0): ONE_BLOCK[tier]}
    index.apply("w1", batch(BlockRemoved(block_hashes=event.block_hashes, medium=medium)))
    assert index.overlaps(index.sequence_hashes(t)) == {} and index.num_blocks() == 0


@pytest.mark.parametrize("layout, want", [
    ((("GPU", 4), ("CPU_TIER1", 6)), Overlap(device=4, dram=2, runner=6)),
    ((("GPU", 4), ("CPU_PINNED", 6)), Overlap(device=4, host=2, runner=0)),
    ((("CPU_TIER1", 2), ("DISK", 5)), Overlap(dram=2, disk=3, runner=5)),
    ((("CPU_TIER1", 2), ("EXTERNAL", 5)), Overlap(dram=2, disk=3, runner=2)),
    ((("CPU_PINNED", 3), ("NVME", 6)), Overlap(host=3, disk=3, runner=6)),
])
def test_runner_depth_counts_the_runners_leading_blocks_apart_from_the_continuation(layout, want,
                                                                                    hash_and_index_loops):
    index = InventoryIndex(block_size=BLOCK)
    t = tokens_for(12, 6)
    for medium, n in layout:  # each medium holds blocks 0..n-1
        index.apply("w1", batch(stored(t, 0, n, medium)[0]))
    assert index.overlaps(index.sequence_hashes(t))[("w1", 0)] == want


MEDIA = ("GPU", "CPU_PINNED", "CPU_TIER1", "DISK", "EXTERNAL")


@pytest.mark.parametrize("gone, kept", list(itertools.permutations(MEDIA, 2)))
def test_the_last_copy_in_one_tier_going_keeps_the_classes_the_other_tier_fills(gone, kept, hash_and_index_loops):
    t = tokens_for(13, 2)
    index, alone = InventoryIndex(block_size=BLOCK), InventoryIndex(block_size=BLOCK)
    ev_gone, ann = stored(t, 0, 2, gone)
    index.apply("w1", batch(ev_gone, stored(t, 0, 2, kept)[0],
                            BlockRemoved(block_hashes=tuple(a.event_hash for a in ann), medium=gone)))
    alone.apply("w1", batch(stored(t, 0, 2, kept)[0]))
    seq = index.sequence_hashes(t)
    assert index.overlaps(seq) == alone.overlaps(seq)
    assert index._masks == alone._masks  # the same lanes, none left behind


def test_removals_are_reference_counted_and_a_clear_wipes_every_tier():
    index = InventoryIndex(block_size=BLOCK)
    t = tokens_for(2, 2)
    event, ann = stored(t, 0, 2, "CPU_PINNED")
    index.apply("w1", batch(event, event))
    seq = index.sequence_hashes(t)
    index.apply("w1", batch(BlockRemoved(block_hashes=(ann[1].event_hash,), medium="CPU_PINNED")))
    assert index.overlaps(seq)[("w1", 0)].depth == 2  # stored twice, removed once
    index.apply("w1", batch(BlockRemoved(block_hashes=(ann[1].event_hash,), medium="CPU_PINNED")))
    assert index.overlaps(seq)[("w1", 0)].depth == 1
    index.apply("w1", batch(stored(t, 0, 1, "GPU")[0], AllBlocksCleared()))
    assert index.overlaps(seq) == {} and index.num_blocks() == 0


@pytest.mark.parametrize("bad", [
    {"block_size": 32}, {"extra": (("locality", "REMOTE"),)},
    {"extra": (("kv_cache_spec_kind", "sliding_window"),)}, {"extra": (("group_idx", 1),)}])
def test_events_dynamo_would_drop_are_ignored(bad):
    index = InventoryIndex(block_size=BLOCK)
    t = tokens_for(3, 2)
    base = stored(t, 0, 2, "GPU")[0]
    fields = {f: getattr(base, f) for f in ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                            "medium", "lora_name", "cache_salt", "extra")}
    if "block_size" in bad:
        fields["token_ids"] = fields["token_ids"] * 2
    index.apply("w1", batch(BlockStored(**{**fields, **bad})))
    assert index.num_blocks() == 0 and index.num_ignored == 1


def test_salted_and_lora_blocks_match_only_requests_with_the_same_namespace():
    index = InventoryIndex(block_size=BLOCK)
    t = tokens_for(4, 2)
    index.apply("w1", batch(stored(t, 0, 2, "GPU", salt="tenant-a")[0]))
    assert index.overlaps(index.sequence_hashes(t)) == {}
    assert index.overlaps(index.sequence_hashes(t, cache_salt="tenant-a"))[("w1", 0)].device == 2


@pytest.mark.parametrize("overlap, want", [
    (Overlap(device=4), 6.0),                   # 10 - 1.0 * 4
    (Overlap(host=8), 4.0),                     # 10 - 0.75 * 8: the engine's host pool
    (Overlap(dram=8, runner=8), 6.0),           # 10 - 0.5 * 8: a runner's DRAM; `runner` earns nothing more
    (Overlap(disk=8, runner=8), 8.0),           # 10 - 0.25 * 8
    (Overlap(device=2, host=2, dram=2, disk=2, runner=4), 10 - 2 - 1.5 - 1 - 0.5),
])
def test_each_tier_is_credited_at_its_weight(overlap, want):
    assert cost(CostModel(), overlap, Load(), 10, BLOCK, 0) == pytest.approx(want)


def test_the_runner_dram_weight_is_its_own_knob():
    model = CostModel(runner_dram_hit_weight=1.0)
    assert cost(model, Overlap(dram=8, runner=8), Load(), 10, BLOCK, 0) == pytest.approx(2.0)
    assert cost(model, Overlap(host=8), Load(), 10, BLOCK, 0) == pytest.approx(4.0)


def test_cost_model_picks_the_cheapest_and_breaks_ties_by_id():
    model = CostModel()
    overlaps = {("a", 0): Overlap(device=4), ("b", 0): Overlap(host=8), ("c", 0): Overlap()}
    assert cost(model, overlaps[("b", 0)], Load(), 10, BLOCK, 0) == pytest.approx(4.0)
    choice = choose(model, list(overlaps), overlaps, {("a", 0): Load(active_prefill_blocks=1)}, 10, BLOCK)
    assert choice.worker == ("b", 0) and choice.costs[("a", 0)] == pytest.approx(7.0)
    assert choose(model, [("z", 0), ("y", 0)], {}, {}, 4, BLOCK).worker == ("y", 0)


def test_the_source_is_the_peer_with_the_strictly_longest_prefix_and_the_hint_parses():
    index = InventoryIndex(block_size=BLOCK)
    t = tokens_for(5, 4)
    ev_a, ann = stored(t, 0, 4, "CPU_TIER1")
    index.apply("a", batch(ev_a))
    index.apply("b", batch(stored(t, 0, 1, "GPU")[0]))
    seq = index.sequence_hashes(t)
    overlaps = index.overlaps(seq)
    envelope = choose_source(index, ("b", 0), seq, overlaps, {("a", 0): "tcp://a:1", ("b", 0): "tcp://b:1"})
    hint = parse_envelope(envelope)
    assert hint.source_control_endpoint == "tcp://a:1"
    assert hint.block_hashes == tuple(to_u64(a.event_hash) for a in ann)  # the source engine's own hashes
    assert choose_source(index, ("a", 0), seq, overlaps, {("b", 0): "tcp://b:1"}) is None


ENDPOINTS = {(w, 0): f"tcp://{w}:1" for w in "abcdt"}


@pytest.mark.parametrize("holdings, source, depth", [
    # a worker holding blocks only on device or in its engine's host pool is never a source
    ({"a": (("GPU", 6),), "b": (("CPU_PINNED", 6),)}, None, 0),
    ({"a": (("GPU", 6),), "b": (("CPU_TIER1", 3),)}, "b", 3),              # by runner depth, not depth
    ({"a": (("GPU", 6), ("CPU_TIER1", 4)), "b": (("DISK", 5),)}, "b", 5),
    ({"a": (("CPU_TIER1", 2), ("DISK", 6)), "b": (("CPU_TIER1", 6),)}, "a", 6),  # a tie: the lower id
    ({"a": (("EXTERNAL", 6),), "b": (("CPU_TIER1", 2), ("EXTERNAL", 6))}, "b", 2),  # a shared pool: not its runner
    ({"a": (("CPU_TIER1", 1),)}, None, 0),                                  # not beyond the target's own depth
])
def test_the_source_is_chosen_by_runner_depth_and_its_hint_names_only_runner_held_blocks(holdings, source, depth):
    index = InventoryIndex(block_size=BLOCK)
    t = tokens_for(14, 6)
    for worker, layout in {**holdings, "t": (("GPU", 1),)}.items():
        for medium, n in layout:
            index.apply(worker, batch(stored(t, 0, n, medium)[0]))
    seq = index.sequence_hashes(t)
    envelope = choose_source(index, ("t", 0), seq, index.overlaps(seq), ENDPOINTS)
    if source is None:
        assert envelope is None
        return
    hint = parse_envelope(envelope)
    assert hint.source_control_endpoint == ENDPOINTS[(source, 0)]
    assert hint.block_hashes == tuple(to_u64(a.event_hash) for a in announce_request(t, BLOCK)[:depth])


@pytest.mark.dynamo
def test_overlaps_equal_what_dynamos_indexer_reports_for_the_same_events(indexer):
    """Random stores and removals over three tiers, published for real to Dynamo's indexer and fed to ours."""
    import zmq

    from tests.dynamo import Registration

    ctx = zmq.Context()
    pub = EventPublisher(ctx, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                         seq=SeqSource(now_us=0), heartbeat_s=0)
    pub.start()
    try:
        reg = Registration(indexer, {"endpoints": {"events": pub.bound_endpoint, "replay": pub.bound_replay_endpoint},
                                     "dp_rank": 0})
        reg.register(reg.info)
        time.sleep(2.0)
        index = InventoryIndex(block_size=BLOCK)
        rng = random.Random(7)
        prompts = [tokens_for(100 + i, 6) for i in range(4)]
        depth = {}  # (prompt, medium) -> blocks stored there, like an engine extends and evicts a chain
        for _ in range(60):
            p, medium = rng.randrange(len(prompts)), rng.choice(["GPU", "CPU_PINNED", "CPU_TIER1", "DISK"])
            d = depth.get((p, medium), 0)
            if d and rng.random() < 0.3:  # evict the chain's tail
                ann = announce_request(prompts[p], BLOCK)[d - 1]
                event = BlockRemoved(block_hashes=(ann.event_hash,), medium=medium)
                depth[(p, medium)] = d - 1
            elif d < 6:
                n = rng.randint(1, 6 - d)
                event = stored(prompts[p], d, n, medium)[0]
                depth[(p, medium)] = d + n
            else:
                continue
            pub.publish([event])
            index.apply("7", batch(event))
        for t in prompts:
            ours = index.overlaps(index.sequence_hashes(t)).get(("7", 0), Overlap())
            want = {"gpu": ours.device * BLOCK, "cpu": (ours.device + ours.host + ours.dram) * BLOCK,
                    "disk": ours.depth * BLOCK}
            wait_until(lambda: {k: reg.query(t).get(k, 0) for k in want} == want, 15, 0.2,
                       f"Dynamo's view {reg.query(t)} equals ours ({want})")
    finally:
        pub.stop()
        ctx.term()


def test_a_clear_in_the_middle_of_a_batch_keeps_what_follows_and_bits_are_reused():
    index = InventoryIndex(block_size=BLOCK)
    t = tokens_for(6, 2)
    first, _ = stored(t, 0, 1, "GPU")
    index.apply("w1", batch(first, AllBlocksCleared(), stored(t, 0, 2, "CPU_TIER1")[0]))
    seq = index.sequence_hashes(t)
    assert index.overlaps(seq)[("w1", 0)] == Overlap(dram=2, runner=2)
    for i in range(200):  # workers coming and going never grow the bitmasks
        index.apply(f"x{i}", batch(first))
        index.remove_worker(f"x{i}")
    assert max(index._bits.values()).bit_length() <= 6  # two workers' lanes, five each


def test_vllm_salt_in_extra_keys_namespaces_the_block():
    index = InventoryIndex(block_size=BLOCK)
    t = tokens_for(7, 1)
    event = BlockStored(block_hashes=(5,), parent_block_hash=None, token_ids=tuple(t), block_size=BLOCK,
                        medium="GPU", extra=(("extra_keys", [["dynamo-cache-salt:tenant-b"]]),))
    index.apply("w1", batch(event))
    assert index.overlaps(index.sequence_hashes(t)) == {}
    assert index.overlaps(index.sequence_hashes(t, cache_salt="tenant-b"))[("w1", 0)].device == 1


def test_numeric_worker_ids_tie_break_numerically():
    assert choose(CostModel(), [("10", 0), ("9", 0)], {}, {}, 4, BLOCK).worker == ("9", 0)


@pytest.mark.parametrize("batches", [[()], [(), ()], [(AllBlocksCleared(),)]])
def test_a_worker_that_only_heartbeat_can_be_cleared_again_and_again(batches):
    """A worker whose stream brought no block yet (heartbeats only) is known but holds no bit: a
    clear (its death, its snapshot) must not fail; this once stopped the router following events."""
    index = InventoryIndex(block_size=16)
    for events in batches:
        index.apply("w", EventBatch(ts=time.time(), events=events))
    index.clear(("w", 0))
    index.clear(("w", 0))
    assert index.num_blocks() == 0


@pytest.mark.parametrize("seed", range(6))
def test_overlaps_follow_per_tier_reference_counts_through_random_stores_removals_and_clears(seed,
                                                                                           hash_and_index_loops):
    # a naive model: per (worker, block) and tier a count; depths read straight from the counts
    rng = random.Random(seed)
    index = InventoryIndex(block_size=BLOCK)
    prompts = [tokens_for(100 + seed * 10 + p, 6) for p in range(2)]
    seqs = [index.sequence_hashes(t) for t in prompts]
    media = {"device": "GPU", "host": "CPU_PINNED", "dram": "CPU_TIER1", "disk": "DISK", "shared": "EXTERNAL"}
    counts: dict = {}
    for _ in range(300):
        worker, p, tier = rng.choice("abc"), rng.randrange(2), rng.choice(list(media))
        op = rng.random()
        if op < 0.5:
            n = rng.randint(1, 6)
            event, ann = stored(prompts[p], 0, n, media[tier])
            index.apply(worker, batch(event))
            for s in seqs[p][:n]:
                counts[worker, s, tier] = counts.get((worker, s, tier), 0) + 1
        elif op < 0.95:
            first = rng.randrange(6)
            _, ann = stored(prompts[p], first, 1, media[tier])
            index.apply(worker, batch(BlockRemoved(block_hashes=(ann[0].event_hash,), medium=media[tier])))
            key = (worker, seqs[p][first], tier)
            if counts.get(key, 0) > 0 and index_knows(counts, worker, seqs[p][first]):
                counts[key] -= 1
        else:
            index.apply(worker, batch(AllBlocksCleared()))
            counts = {k: v for k, v in counts.items() if k[0] != worker}
        for q in range(2):
            assert index.overlaps(seqs[q]) == expected_overlaps(counts, seqs[q]), (seed, q)


def index_knows(counts: dict, worker: str, seq: int) -> bool:
    return any(counts.get((worker, seq, t), 0) for t in ("device", "host", "dram", "disk", "shared"))


def expected_overlaps(counts: dict, seq_hashes: list[int]) -> dict:
    out = {}
    for worker in "abc":
        def held(s, tiers):
            return any(counts.get((worker, s, t), 0) > 0 for t in tiers)

        def run(tiers):
            n = 0
            while n < len(seq_hashes) and held(seq_hashes[n], tiers):
                n += 1
            return n
        dev, dh, dhr = run(("device",)), run(("device", "host")), run(("device", "host", "dram"))
        anywhere = run(("device", "host", "dram", "disk", "shared"))
        if anywhere:
            out[(worker, 0)] = Overlap(dev, dh - dev, dhr - dh, anywhere - dhr, runner=run(("dram", "disk")))
    return out


def _random_stream(seed: int, n: int = 400):
    """Stores (runs from the root or continuing one), removals in every tier, duplicates, clears."""
    rng = random.Random(seed)
    prompts = [tokens_for(500 + seed * 10 + p, 8) for p in range(3)]
    media = ("GPU", "CPU_PINNED", "CPU_TIER1", "DISK", "NVME", "EXTERNAL")
    for _ in range(n):
        worker, p, medium, op = rng.choice("ab"), rng.randrange(3), rng.choice(media), rng.random()
        if op < 0.6:
            first = rng.choice((0, rng.randrange(8)))
            yield worker, stored(prompts[p], first, rng.randint(1, 8 - first), medium)[0]
        elif op < 0.98:
            first = rng.randrange(8)
            _, ann = stored(prompts[p], first, rng.randint(1, 8 - first), medium)
            yield worker, BlockRemoved(block_hashes=tuple(a.event_hash for a in ann), medium=medium)
        else:
            yield worker, AllBlocksCleared()


def _index_state(index: InventoryIndex):
    return (index._masks, {w: (s.by_external, s.held) for w, s in index._workers.items()},
            index.num_unknown_parent, index.num_events)


@pytest.mark.parametrize("seed", range(4))
def test_the_c_index_loops_leave_exactly_the_state_the_python_ones_do(seed, monkeypatch):
    from router_hints import index as index_module

    if index_module._count_stored is index_module._count_stored_py:
        pytest.skip("the C index loops were not built on this host")
    states = []
    for loops in ("native", "python"):
        if loops == "python":
            monkeypatch.setattr(index_module, "_count_stored", index_module._count_stored_py)
            monkeypatch.setattr(index_module, "_count_removed", index_module._count_removed_py)
        index = InventoryIndex(block_size=BLOCK)
        for worker, event in _random_stream(seed):
            index.apply(worker, batch(event))
        states.append(_index_state(index))
    assert states[0] == states[1]
    assert states[0][0], "the stream should leave some blocks held"


@pytest.mark.parametrize("call, problem", [
    (lambda n: n.stored({}, {}, [1], [2], 0, 1), "slot 0"),
    (lambda n: n.stored({}, {}, [1], [2], 6, 1), "slot 6"),
    (lambda n: n.stored({2: (1, 0, 0, 0, 0, 0)}, {}, [1], [2], 1, 1), "held entry"),
    (lambda n: n.removed({1: 2}, {2: [1, 1]}, {}, [1], 1, 1, (0,) * 32), "held entry"),
    (lambda n: n.removed({1: 2}, {2: [1, 1, 0, 0]}, {}, [1], 1, 1, (0,) * 32), "held entry"),  # the 3-tier entry
    (lambda n: n.removed({}, {}, {}, [1], 2, 1, (0,) * 8), "drops"),
    (lambda n: n.stored({}, {}, 5, [2], 1, 1), "externals"),
])
def test_the_c_index_loops_refuse_what_the_index_never_passes_by_name(call, problem):
    native = pytest.importorskip("router_hints._inventory")
    with pytest.raises((TypeError, ValueError), match=problem):
        call(native)


def test_the_c_index_loops_count_the_tiers_the_index_does():
    from router_hints import index as index_module

    native = pytest.importorskip("router_hints._inventory")
    assert native.NUM_TIERS == index_module._NUM_TIERS
    assert len(index_module._DROP_LANES[0]) == 1 << native.NUM_TIERS
