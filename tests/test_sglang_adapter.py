"""KVCRStorage against SGLang 0.5.23's real classes on the CPU: host pools (MHA and MLA, every
layout), the `dynamic` factory, the controller's own backup / hit-query / transfer code, and two
backends reusing each other's pages through hints."""

import signal
import threading
import time

import pytest
import torch

from tests.sglang_pools import (  # installs the torchvision stub first
    LAYOUTS,
    PAGE,
    controller,
    fill,
    keys_for,
    mha_pool,
    mla_pool,
    no_claims_left,
    page_bytes,
    storage_config,
)

# isort: split
from sglang.srt.managers.cache_controller import (  # noqa: E402
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvcr.client import AttachedWriter, ControlClient  # noqa: E402
from kvcr.drivers.shm import sweep_stale  # noqa: E402
from kvcr.proto import messages as m  # noqa: E402
from kvcr.proto.hints import build_envelope  # noqa: E402
from kvcr.proto.keys import U64_MASK, hash_str_to_int64, page_hashes  # noqa: E402
from sglang_adapter.config import AdapterConfigError  # noqa: E402
from sglang_adapter.layout import PageLayout  # noqa: E402

POOLS = [pytest.param(maker, layout, id=f"{maker.__name__}-{layout}") for maker in (mha_pool, mla_pool)
         for layout in LAYOUTS]


@pytest.mark.parametrize("maker, layout", POOLS)
def test_pages_round_trip_through_the_runner_for_every_layout(backends, maker, layout):
    pool = maker(layout, page=PAGE)
    backend = backends(pool, mla=maker is mla_pool)
    keys = keys_for(6)
    src, dst = pool.alloc(6 * PAGE), pool.alloc(6 * PAGE)
    fill(pool, src, seed=1)
    assert backend.batch_set_v1(keys, src) == [True] * 6
    assert backend.batch_set_v1(keys[:2], src[:2 * PAGE]) == [True, True]  # present keys count as stored
    assert backend.batch_exists(keys + keys_for(2, seed=9)) == 6
    assert backend.batch_get_v1(keys, dst) == [True] * 6
    assert page_bytes(pool, dst) == page_bytes(pool, src)
    assert backend.runner.pools["kv"].page_bytes == PageLayout.of(pool).page_bytes


def exists_with_hint(backend, keys, source_backend) -> int:
    envelope = build_envelope(source_backend.service.control.bound_endpoint,
                              [hash_str_to_int64(k) & U64_MASK for k in keys])
    return backend.batch_exists(keys, HiCacheStorageExtraInfo(extra_info={"kv_hints": envelope}))


@pytest.mark.parametrize("hint_path", ["request", "posted"])
def test_a_second_backend_confirms_claims_and_loads_the_first_ones_pages(backends, hint_path):
    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("page_first", page=PAGE)
    a, b = backends(pool_a), backends(pool_b)
    keys = keys_for(8, seed=3)
    src = pool_a.alloc(8 * PAGE)
    fill(pool_a, src, seed=2)
    assert a.batch_set_v1(keys, src) == [True] * 8
    ask = keys + keys_for(3, seed=4)  # a longer request: only A's 8 pages can be confirmed
    if hint_path == "request":
        hit = exists_with_hint(b, ask, a)
    else:  # the router posts the hint to B's runner; SGLang passes no hint to the backend
        hashes = [hash_str_to_int64(k) & U64_MASK for k in keys]
        with ControlClient(b.service.control.bound_endpoint) as client:
            client.request(m.PostHint(envelope=build_envelope(a.service.control.bound_endpoint, hashes)))
        hit = b.batch_exists(ask)
    assert hit == 8
    assert a.runner.claims.statistics().num_claims == 1  # confirmed means claimed at the source
    dst = pool_b.alloc(8 * PAGE)
    assert b.batch_get_v1(keys, dst) == [True] * 8
    assert page_bytes(pool_b, dst) == page_bytes(pool_a, src)
    assert b.claims_pending() == 0
    no_claims_left(a)


def pulled_by_b(backends, n: int, seed: int):
    """A holds n pages; B confirms them through a hint and reads them into its host pages."""
    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("page_first", page=PAGE)
    a, b = backends(pool_a), backends(pool_b)
    keys = keys_for(n, seed=seed)
    src = pool_a.alloc(n * PAGE)
    fill(pool_a, src, seed=seed)
    assert a.batch_set_v1(keys, src) == [True] * n
    assert exists_with_hint(b, keys, a) == n
    dst = pool_b.alloc(n * PAGE)
    return a, b, pool_b, keys, dst, page_bytes(pool_a, src)


def test_pages_pulled_into_host_pages_are_kept_in_the_runner_after_the_read(backends):
    a, b, pool_b, keys, dst, want = pulled_by_b(backends, 6, seed=21)
    assert b.batch_get_v1(keys, dst) == [True] * 6
    b.wait_kept()
    assert b.runner.lookup("kv", b.runner.keys("kv", keys)) == 6
    again = pool_b.alloc(6 * PAGE)
    assert b.batch_exists(keys) == 6 and b.claims_pending() == 0  # a local hit now: no claim taken
    assert b.batch_get_v1(keys, again) == [True] * 6
    assert page_bytes(pool_b, again) == want


def test_a_host_slot_is_freed_only_after_the_keep_reading_it(backends):
    # The keep copies out of SGLang's host pages after the read returns. SGLang rewrites a slot only
    # after freeing and allocating it again, so the free of a slot a keep still reads waits for it.
    a, b, pool_b, keys, dst, want = pulled_by_b(backends, 4, seed=22)
    other = pool_b.alloc(4 * PAGE)
    gate = threading.Event()
    b.host.keeper.submit(gate.wait)  # the keeper is busy: the pulled pages' keep queues behind
    assert b.batch_get_v1(keys, dst) == [True] * 4
    unrelated = threading.Thread(target=pool_b.free, args=(other,))  # slots no keep reads: freed at once
    unrelated.start()
    unrelated.join(10)
    assert not unrelated.is_alive()
    freeing = threading.Thread(target=pool_b.free, args=(dst,))
    freeing.start()
    freeing.join(0.3)
    assert freeing.is_alive()
    gate.set()
    freeing.join(10)
    assert not freeing.is_alive()
    assert b.runner.lookup("kv", b.runner.keys("kv", keys)) == 4  # kept before the slots went back
    reused = pool_b.alloc(pool_b.available_size())  # every free slot, the pulled ones among them
    fill(pool_b, reused, seed=99)  # SGLang rewrites them: what we kept is unchanged
    pool_b.free(reused)
    local = pool_b.alloc(4 * PAGE)
    assert b.batch_get_v1(keys, local) == [True] * 4
    assert page_bytes(pool_b, local) == want


def test_a_claim_never_collected_is_given_back(backends):
    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("page_first", page=PAGE)
    a, b = backends(pool_a), backends(pool_b, claim_lease_s=0.2)
    keys = keys_for(4, seed=5)
    a.batch_set_v1(keys, pool_a.alloc(4 * PAGE))
    assert exists_with_hint(b, keys, a) == 4
    time.sleep(0.3)  # SGLang's prefetch ended without a batch_get
    b.batch_exists(keys_for(1, seed=6))
    assert b.num_claims_expired == 1
    no_claims_left(a)


def test_a_peer_with_another_namespace_is_refused(backends):
    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("layer_first", page=PAGE)
    a, b = backends(pool_a), backends(pool_b)
    keys = keys_for(4, seed=7)
    a.batch_set_v1(keys, pool_a.alloc(4 * PAGE))
    assert exists_with_hint(b, keys, a) == 0  # layout differs: the claim is refused by name, nothing loads


def test_the_controller_backs_up_finds_and_transfers_through_the_backend(backends):
    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("page_first", page=PAGE)
    a, b = backends(pool_a), backends(pool_b)
    tokens = list(range(500, 500 + 10 * PAGE))
    keys = page_hashes(tokens, PAGE)
    src = pool_a.alloc(10 * PAGE)
    fill(pool_a, src, seed=8)
    ca, cb = controller(a, pool_a), controller(b, pool_b)
    ca._page_backup(StorageOperation(src, tokens, hash_value=keys, prefix_keys=[]))
    assert a.batch_exists(keys) == 10
    # B: the router's hint is posted to its runner, then the controller's own hit query and transfer
    with ControlClient(b.service.control.bound_endpoint) as client:
        client.request(m.PostHint(envelope=build_envelope(a.service.control.bound_endpoint,
                                                          [hash_str_to_int64(k) & U64_MASK for k in keys])))
    op = PrefetchOperation("req-1", tokens, last_hash=None, prefix_keys=[])
    hashes, hit_tokens = cb._storage_hit_query(op)
    assert hashes == keys and hit_tokens == 10 * PAGE
    op.hash_value, op.host_indices = hashes, pool_b.alloc(10 * PAGE)
    assert cb._page_transfer(op) == 10  # pages; the ack carries the tokens the scheduler inserts
    assert cb.prefetch_sync_queue.get_nowait().completed_tokens == 10 * PAGE
    assert page_bytes(pool_b, op.host_indices) == page_bytes(pool_a, src)
    no_claims_left(a)


# get: claim, then GETs from a peer that is dead by then; inline: the small claim's answer carried
# the bytes before the kill; auto: the same-host copy from the dead peer's pool, still mapped.
@pytest.mark.parametrize("transfer, inline, survive", [("get", 0, 0), ("get", 1 << 20, 5), ("auto", 0, 5)],
                         ids=["get", "inline", "auto"])
def test_a_peer_killed_mid_prefetch_counts_only_the_delivered_leading_pages(backends, runner_factory, transfer,
                                                                            inline, survive):
    pool_b = mha_pool("page_first", page=PAGE)
    b = backends(pool_b, runner={"dram.size": "4Mi", "runner.transfer": transfer, "runner.inline_pull_bytes": inline})
    layout = PageLayout.of(pool_b)
    a = runner_factory("a", **{"dram.pools": [{"name": "kv", "page_bytes": layout.page_bytes}],
                               "runner.block_size": PAGE, "namespace.model": "test/model",
                               "namespace.layout": "page_first", "namespace.dtype": "bfloat16",
                               "runner.inline_pull_bytes": 1 << 20})
    info = a.start()
    keys = keys_for(5, seed=11)
    data = [bytes([i + 1]) * layout.page_bytes for i in range(5)]
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        writer.put("kv", keys, data)
        writer.close()
    envelope = build_envelope(info["endpoints"]["control"], [hash_str_to_int64(k) & U64_MASK for k in keys])
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(extra_info={"kv_hints": envelope})) == 5
    a.stop(signal.SIGKILL)
    cb = controller(b, pool_b)
    op = PrefetchOperation("req-2", [0] * 5 * PAGE, prefix_keys=[])
    op.hash_value, op.host_indices = keys, pool_b.alloc(5 * PAGE)
    completed = cb._page_transfer(op)
    assert cb.prefetch_sync_queue.get_nowait().completed_tokens == completed * PAGE
    got = page_bytes(pool_b, op.host_indices)
    segments = len(got) // 5
    arrived = [b"".join(got[i * segments:(i + 1) * segments]) == data[i] for i in range(5)]
    # The count is the run of pages that truly arrived.
    assert arrived[:completed] == [True] * completed
    assert completed == survive
    assert b.claims_pending() == 0
    a.proc.wait(5)
    sweep_stale()  # the killed runner's region, as its restart would


@pytest.mark.parametrize("extra, problem", [
    ({"claim_leese_s": 3}, "unknown key 'claim_leese_s'"),
    ({"claim_lease_s": "3"}, "'claim_lease_s' must be float"),
    ({"use_posted_hints": 1}, "'use_posted_hints' must be bool"),
    ({"pull_timeout_s": 0}, "'pull_timeout_s' must be > 0"),
])
def test_a_bad_extra_config_is_refused_with_the_key_named(extra, problem):
    pool = mha_pool("page_first", page=PAGE)
    with pytest.raises(AdapterConfigError, match=problem):
        StorageBackendFactory.create_backend("dynamic", storage_config(**extra), pool)


def test_the_byte_copy_interface_and_clear(backends):
    pool = mha_pool("page_first", page=PAGE)
    backend = backends(pool, interface_v1=0)
    keys = keys_for(3, seed=12)
    flat = [torch.randint(0, 100, (PageLayout.of(pool).page_bytes // 2,), dtype=torch.int16).view(torch.bfloat16)
            for _ in keys]
    assert backend.batch_set(keys, flat)
    out = backend.batch_get(keys, [torch.empty_like(f) for f in flat])
    assert all(torch.equal(o.view(torch.int16), f.view(torch.int16)) for o, f in zip(out, flat))
    assert backend.exists(keys[0])
    backend.clear()
    assert backend.batch_exists(keys) == 0 and backend.get(keys[0]) is None


def test_a_hint_naming_an_unreachable_peer_is_a_miss_not_an_error(backends):
    pool = mha_pool("page_first", page=PAGE)
    backend = backends(pool, pull_timeout_s=0.5)
    keys = keys_for(3, seed=13)
    envelope = build_envelope("tcp://127.0.0.1:9", [hash_str_to_int64(k) & U64_MASK for k in keys])  # nobody there
    assert backend.batch_exists(keys, HiCacheStorageExtraInfo(extra_info={"kv_hints": envelope})) == 0
    assert backend.claims_pending() == 0


SPAN = 4  # host pages per storage key in span mode


def span_backend(backends_made: list):
    """Span mode as SGLang after 0.5.23 sets it up (storage_page_size on the config, pools
    registered through v2), synthesized on 0.5.23's real pools: a KV pool and, standing in for a
    Mamba state pool, a pool with one slot per page."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv_pool, state_pool = mha_pool("page_first", page=PAGE, tokens=512), mha_pool("page_first", page=1, tokens=64)
    cfg = storage_config(layout="page_first")
    cfg.storage_page_size = SPAN * PAGE  # the upstream field 0.5.23 lacks
    backend = StorageBackendFactory.create_backend("dynamic", cfg, kv_pool)
    backends_made.append(backend)
    assert backend.supports_page_spans
    backend.register_mem_pool_host(kv_pool)
    backend.register_mem_host_pool_v2(kv_pool, PoolName.KV)
    backend.register_mem_host_pool_v2(state_pool, PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend, kv_pool, state_pool


@pytest.fixture
def span():
    made = []
    yield lambda: span_backend(made)
    for b in made:
        b.close()


def transfers(kv_idx, state_idx, keys, *, state_keys=None):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return [PoolTransfer(PoolName.KV, host_indices=kv_idx, keys=keys),
            PoolTransfer(PoolName.MAMBA, host_indices=state_idx, keys=state_keys or keys,
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)]


def test_span_mode_keeps_a_span_of_kv_pages_and_one_state_slot_per_key(span):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, kv_pool, state_pool = span()
    keys = keys_for(3, seed=21)
    kv_src, st_src = kv_pool.alloc(3 * SPAN * PAGE), state_pool.alloc(3)
    fill(kv_pool, kv_src, seed=1)
    fill(state_pool, st_src, seed=2)
    assert backend.batch_set_v2(transfers(kv_src, st_src, keys)) == {PoolName.KV: [True] * 3,
                                                                       PoolName.MAMBA: [True] * 3}
    result = backend.batch_exists_v2(keys + keys_for(1, seed=22), transfers(None, None, keys, state_keys=keys[-1:]))
    assert result.kv_hit_pages == 3 and result.restorable_prefix_pages == [1, 2, 3]
    kv_dst, st_dst = kv_pool.alloc(3 * SPAN * PAGE), state_pool.alloc(3)
    got = backend.batch_get_v2(transfers(kv_dst, st_dst, keys))
    assert got == {PoolName.KV: [True] * 3, PoolName.MAMBA: [True] * 3}
    assert page_bytes(kv_pool, kv_dst) == page_bytes(kv_pool, kv_src)
    assert page_bytes(state_pool, st_dst) == page_bytes(state_pool, st_src)


def test_a_state_pool_restores_only_prefixes_that_end_on_a_saved_state(span):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    backend, kv_pool, state_pool = span()
    keys = keys_for(3, seed=23)
    backend.batch_set_v1(keys, kv_pool.alloc(3 * SPAN * PAGE))  # v1 in span mode: a key covers SPAN pages
    state = PoolTransfer(PoolName.MAMBA, host_indices=state_pool.alloc(1), keys=keys[2:])
    assert backend.batch_set_v2([state]) == {PoolName.MAMBA: [True]}
    result = backend.batch_exists_v2(keys, transfers(None, None, keys, state_keys=keys[-1:]))
    assert result.kv_hit_pages == 3 and result.restorable_prefix_pages == [3]


def test_a_transfer_whose_slots_do_not_match_the_span_is_refused(span):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    backend, kv_pool, _ = span()
    keys = keys_for(2, seed=24)
    short = PoolTransfer(PoolName.KV, host_indices=kv_pool.alloc(2 * PAGE), keys=keys)  # one page per key
    assert backend.batch_set_v2([short]) == {PoolName.KV: [False, False]}
    assert backend.batch_exists(keys) == 0


def test_a_span_is_announced_as_its_engine_pages_continuing_the_chain(span):
    from kvcr.proto.events import BlockStored
    from kvcr.proto.keys import page_hashes

    backend, kv_pool, _ = span()
    tokens = list(range(700, 700 + 3 * SPAN * PAGE))
    keys = page_hashes(tokens, SPAN * PAGE)  # span keys hash SPAN engine pages at a time
    engine = page_hashes(tokens, PAGE)       # what the engine announces: one block per engine page
    first = HiCacheStorageExtraInfo(prefix_keys=[], extra_info={"token_ids": tokens[:SPAN * PAGE]})
    rest = HiCacheStorageExtraInfo(prefix_keys=keys[:1], extra_info={"token_ids": tokens[SPAN * PAGE:]})
    assert backend.batch_set_v1(keys[:1], kv_pool.alloc(SPAN * PAGE), first) == [True]
    assert backend.batch_set_v1(keys[1:], kv_pool.alloc(2 * SPAN * PAGE), rest) == [True, True]
    with backend.runner.lock:
        stored = [e for e in backend.runner.events.inventory() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == [hash_str_to_int64(h) for h in engine]
    assert stored[0].parent_block_hash is None and all(e.block_size == PAGE for e in stored)
    with backend.runner.lock:  # the pool's own events, before the runner publishes them
        pool = backend.runner.pools["kv"]
        pool.remove([backend.runner.key("kv", keys[2])])
        removed = pool.take_events()[-1]
    assert list(removed.block_hashes) == [hash_str_to_int64(h) for h in engine[-SPAN:]]


def test_sglangs_storage_metrics_report_the_window_since_the_last_report_then_start_afresh():
    from sglang_adapter.transfer_stats import TransferStats

    stats = TransferStats()
    stats.prefetched(4, time.perf_counter() - 0.5)
    stats.backed_up(2, time.perf_counter() - 1.0)
    stats.from_peers(3)
    first = stats.report(page_bytes=2**30)
    assert (first.prefetch_pgs, first.backup_pgs) == ([4], [2])
    assert 0 < first.prefetch_bandwidth[0] <= 8.0 and 0 < first.backup_bandwidth[0] <= 2.0  # GiB/s
    second = stats.report(page_bytes=2**30)
    assert (second.prefetch_pgs, second.backup_pgs, second.prefetch_bandwidth) == ([0], [0], [0])


@pytest.mark.parametrize("rank", [0, 1])
def test_each_dp_rank_gets_the_extra_configs_ports_plus_its_rank_and_a_range_past_65535_stops_every_rank(rank):
    from kvcr.config import ConfigError
    from sglang_adapter.config import parse_adapter_config
    from sglang_adapter.dp import DpPlacement
    from sglang_adapter.runner_setup import POOL, key_layout, runner_config

    layouts = {POOL: key_layout(mha_pool("page_first", page=PAGE), {}, None)}

    def config(control: str):
        sc = storage_config(runner={"dram.size": "4Mi", "runner.control_endpoint": control, "runner.http_port": 9000})
        return runner_config(sc, parse_adapter_config(sc.extra_config), layouts, interface_v1=True,
                             placement=DpPlacement(rank=rank, size=2))
    cfg = config("tcp://127.0.0.1:5600")
    assert (cfg.runner.dp_rank, cfg.runner.dp_size) == (rank, 2)
    assert (cfg.runner.control_endpoint, cfg.runner.http_port) == (f"tcp://127.0.0.1:{5600 + rank}", 9000 + rank)
    with pytest.raises(ConfigError, match="runner.control_endpoint = 'tcp://127.0.0.1:65535'"):
        config("tcp://127.0.0.1:65535")
