"""TP > 1 and MLA: SGLang ranks (real 0.5.23 host pools, one backend each) attached to a
`kvcr serve` sidecar that keeps every shard of a page together."""

import pytest

from tests.sglang_pools import PAGE, fill, keys_for, mha_pool, page_bytes, storage_config  # torchvision stub first

# isort: split
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvcr.client import ControlClient  # noqa: E402
from kvcr.demo.httpc import http  # noqa: E402
from kvcr.proto import messages as m  # noqa: E402
from kvcr.proto.hints import build_envelope  # noqa: E402
from kvcr.proto.keys import U64_MASK, hash_str_to_int64  # noqa: E402
from sglang_adapter.layout import PageLayout  # noqa: E402
from tests.helpers import wait_until  # noqa: E402

SIDECAR = {"backend_name": "kvcr", "module_path": "sglang_adapter.sidecar", "class_name": "KVCRSidecarStorage",
           "interface_v1": 1}


def start_sidecar(runner_factory, name: str, shards: int, *, mla: bool = False) -> dict:
    shard_bytes = PageLayout.of(mha_pool("page_first", page=PAGE)).page_bytes
    return runner_factory(name, **{"dram.pools": [{"name": "kv", "page_bytes": shard_bytes * shards,
                                                   "shards": shards}],
                                   "runner.block_size": PAGE, "namespace.model": "test/model",
                                   "namespace.layout": "page_first", "namespace.dtype": "bfloat16",
                                   "namespace.tp_size": max(shards, 2 if mla else 1), "namespace.is_mla": mla,
                                   "runner.peers": ["*"]}).start()


@pytest.fixture
def ranks():
    made = []

    def attach(info: dict, tp_rank: int, tp_size: int, *, mla: bool = False, interface_v1: int = 1):
        pool = mha_pool("page_first", page=PAGE)
        cfg = storage_config(mla, "page_first")
        cfg.tp_rank, cfg.tp_size = tp_rank, tp_size
        cfg.extra_config = {**SIDECAR, "sidecar": info["endpoints"]["control"], "interface_v1": interface_v1}
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        made.append(backend)
        return backend, pool

    yield attach
    for b in made:
        b.close()


def test_a_page_is_served_only_once_every_rank_backed_up_its_shard(runner_factory, ranks):
    info = start_sidecar(runner_factory, "sidecar", 2)
    (r0, p0), (r1, p1) = ranks(info, 0, 2), ranks(info, 1, 2)
    keys = keys_for(5, seed=31)
    src0, src1 = p0.alloc(5 * PAGE), p1.alloc(5 * PAGE)
    fill(p0, src0, seed=1)
    fill(p1, src1, seed=2)
    assert r0.batch_set_v1(keys, src0) == [True] * 5
    assert r0.batch_exists(keys) == 0 and r1.batch_exists(keys) == 0  # rank 1's shard is missing
    assert r1.batch_set_v1(keys, src1) == [True] * 5
    assert r0.batch_exists(keys) == 5 and r1.batch_exists(keys) == 5
    dst0, dst1 = p0.alloc(5 * PAGE), p1.alloc(5 * PAGE)
    assert r0.batch_get_v1(keys, dst0) == [True] * 5 and r1.batch_get_v1(keys, dst1) == [True] * 5
    assert page_bytes(p0, dst0) == page_bytes(p0, src0)  # each rank gets its own shard back
    assert page_bytes(p1, dst1) == page_bytes(p1, src1)


def test_under_mla_the_writer_ranks_pages_hit_on_every_rank(runner_factory, ranks):
    info = start_sidecar(runner_factory, "mla-sidecar", 1, mla=True)
    (writer, pw), (reader, pr) = ranks(info, 0, 2, mla=True), ranks(info, 1, 2, mla=True)
    keys = keys_for(4, seed=32)
    src = pw.alloc(4 * PAGE)
    fill(pw, src, seed=3)
    assert writer.batch_set_v1(keys, src) == [True] * 4  # only the writer rank backs up under MLA
    assert reader.batch_exists(keys) == 4
    dst = pr.alloc(4 * PAGE)
    assert reader.batch_get_v1(keys, dst) == [True] * 4
    assert page_bytes(pr, dst) == page_bytes(pw, src)


def claims_held(info: dict) -> float:
    text = http(info["endpoints"]["http"] + "/metrics")[2].decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvcr_claims_held "))


def two_workers(runner_factory, ranks, keys):
    a_info, b_info = start_sidecar(runner_factory, "sidecar-a", 2), start_sidecar(runner_factory, "sidecar-b", 2)
    a = [ranks(a_info, r, 2) for r in range(2)]
    b = [ranks(b_info, r, 2) for r in range(2)]
    sources = []
    for (backend, pool), seed in zip(a, (4, 5)):
        src = pool.alloc(len(keys) * PAGE)
        fill(pool, src, seed=seed)
        assert backend.batch_set_v1(keys, src) == [True] * len(keys)
        sources.append((pool, src))
    return a_info, b_info, b, sources


def read_back(b, sources, keys):
    for (backend, pool), (src_pool, src) in zip(b, sources):
        dst = pool.alloc(len(keys) * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * len(keys)
        assert page_bytes(pool, dst) == page_bytes(src_pool, src)


def test_with_a_request_hint_each_rank_gets_its_slice_from_the_peers_sidecar(runner_factory, ranks):
    keys = keys_for(6, seed=33)
    a_info, b_info, b, sources = two_workers(runner_factory, ranks, keys)
    hint = HiCacheStorageExtraInfo(extra_info={"kv_hints": build_envelope(
        a_info["endpoints"]["control"], [hash_str_to_int64(k) & U64_MASK for k in keys])})
    assert [backend.batch_exists(keys, hint) for backend, _ in b] == [6, 6]  # each rank's own claim at A
    read_back(b, sources, keys)
    with ControlClient(b_info["endpoints"]["control"]) as client:  # straight into host pages: not via B
        assert client.request(m.Lookup(pool="kv", keys=keys)).num_ready == 0
    wait_until(lambda: claims_held(a_info) == 0, 5, 0.05, "every rank's claim at A released")


def test_with_a_posted_hint_the_sidecar_pulls_whole_pages_for_every_rank(runner_factory, ranks):
    keys = keys_for(6, seed=34)
    a_info, b_info, b, sources = two_workers(runner_factory, ranks, keys)
    with ControlClient(b_info["endpoints"]["control"]) as client:  # what our router does
        client.request(m.PostHint(envelope=build_envelope(
            a_info["endpoints"]["control"], [hash_str_to_int64(k) & U64_MASK for k in keys])))
    assert [backend.batch_exists(keys) for backend, _ in b] == [6, 6]
    read_back(b, sources, keys)


def test_a_sidecar_holding_other_pages_is_refused_by_name(runner_factory, ranks):
    info = start_sidecar(runner_factory, "wrong-sidecar", 4)  # pages of 4 shards: this engine has TP 2
    with pytest.raises(ValueError, match="page_bytes: sidecar"):
        ranks(info, 0, 2)


def test_the_byte_copy_interface_and_a_flush_through_the_sidecar(runner_factory, ranks):
    import torch

    shard_bytes = PageLayout.of(mha_pool("page_first", page=PAGE)).page_bytes
    info = runner_factory("flat-sidecar", **{"dram.pools": [{"name": "kv", "page_bytes": 2 * shard_bytes,
                                                             "shards": 2}],
                                             "runner.block_size": PAGE, "namespace.model": "test/model",
                                             "namespace.layout": "flat-page_first", "namespace.dtype": "bfloat16",
                                             "namespace.tp_size": 2}).start()
    r0, r1 = (ranks(info, r, 2, interface_v1=0)[0] for r in range(2))
    keys = keys_for(3, seed=35)
    pages = {r: [torch.full((shard_bytes,), 10 * r + i, dtype=torch.uint8) for i in range(3)] for r in (0, 1)}
    assert r0.batch_set(keys, pages[0]) and r0.batch_exists(keys) == 0  # rank 1's slices are missing
    assert r1.batch_set(keys, pages[1]) and r1.batch_exists(keys) == 3
    got = r1.batch_get(keys, [torch.empty(shard_bytes, dtype=torch.uint8) for _ in keys])
    assert all(torch.equal(g, p) for g, p in zip(got, pages[1]))
    r0.clear()
    assert r1.batch_exists(keys) == 0
