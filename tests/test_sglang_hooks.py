"""The launcher and its three hooks, each against the real SGLang 0.5.23 classes."""

import json
import logging
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.sglang_pools import (  # installs the torchvision stub first
    PAGE,
    controller,
    fill,
    mha_pool,
    no_claims_left,
    page_bytes,
)

# isort: split
from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation  # noqa: E402
from sglang.srt.managers.kv_hints import decode_kv_hints_envelope  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache, _OngoingPrefetch  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from kvcr.proto.events import BlockStored  # noqa: E402
from kvcr.proto.hints import build_envelope  # noqa: E402
from kvcr.proto.keys import U64_MASK, hash_str_to_int64, page_hashes  # noqa: E402
from sglang_adapter import hooks, releases  # noqa: E402
from sglang_adapter.launch_server import DYNAMIC, TIMEOUTS, LaunchError, main, rewrite_args  # noqa: E402
from tests.helpers import wait_until  # noqa: E402

hooks.install()


def request(rid: str, envelope: dict | None, tokens: list[int] = (), extra_key: str | None = None,
            cache_salt: str | None = None) -> SimpleNamespace:
    """What `_prefetch_kvcache` reads of a Req before the (disabled) storage path."""
    return SimpleNamespace(rid=rid, kv_hints=decode_kv_hints_envelope(envelope) if envelope else None,
                           origin_input_ids=list(tokens), output_ids=[], extra_key=extra_key, cache_salt=cache_salt)


def idle_scheduler() -> Scheduler:
    sched = object.__new__(Scheduler)
    sched.enable_hicache_storage = sched.enable_lmcache = False  # the real method then does nothing
    return sched


def stored_pair(backends, pages: int, seed: int):
    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("page_first", page=PAGE)
    a, b = backends(pool_a), backends(pool_b)
    tokens = list(range(seed, seed + pages * PAGE))
    keys = page_hashes(tokens, PAGE)
    src = pool_a.alloc(pages * PAGE)
    fill(pool_a, src, seed=seed)
    assert a.batch_set_v1(keys, src) == [True] * pages
    return a, b, pool_b, tokens, keys


def test_a_requests_kv_hints_reach_the_backends_lookup(backends):
    a, b, pool_b, tokens, keys = stored_pair(backends, 6, seed=100)
    envelope = build_envelope(a.service.control.bound_endpoint, [hash_str_to_int64(k) & U64_MASK for k in keys])
    cb = controller(b, pool_b)
    _, hit_tokens = cb._storage_hit_query(PrefetchOperation("rid-hinted", tokens, prefix_keys=[]))
    assert hit_tokens == 0  # SGLang passes no hint of its own: B finds nothing
    Scheduler._prefetch_kvcache(idle_scheduler(), request("rid-hinted", envelope))
    _, hit_tokens = cb._storage_hit_query(PrefetchOperation("rid-hinted", tokens, prefix_keys=[]))
    assert hit_tokens == 6 * PAGE and b.claims_pending() == 1
    hooks.REQUEST_HINTS.pop("rid-hinted")


def test_backed_up_pages_carry_their_tokens_and_are_announced(backends):
    pool = mha_pool("page_first", page=PAGE)
    a = backends(pool)
    tokens = list(range(300, 300 + 5 * PAGE))
    keys = page_hashes(tokens, PAGE)
    indices = pool.alloc(5 * PAGE)
    controller(a, pool)._page_backup(StorageOperation(indices, tokens, hash_value=keys, prefix_keys=[]))
    with a.runner.lock:
        stored = [e for e in a.runner.events.inventory() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == [hash_str_to_int64(k) for k in keys]
    assert [t for e in stored for t in e.token_ids] == tokens
    assert stored[0].parent_block_hash is None


def test_an_ended_prefetch_gives_back_the_claims_it_will_not_collect(backends):
    a, b, pool_b, tokens, keys = stored_pair(backends, 4, seed=200)
    envelope = build_envelope(a.service.control.bound_endpoint, [hash_str_to_int64(k) & U64_MASK for k in keys])
    Scheduler._prefetch_kvcache(idle_scheduler(), request("rid-ended", envelope))
    cb = controller(b, pool_b)
    op = PrefetchOperation("rid-ended", tokens, prefix_keys=[])
    op.hash_value, hit = cb._storage_hit_query(op)
    assert hit == 4 * PAGE and b.claims_pending() == 1
    cb.terminate_prefetch(op)  # the scheduler's timeout: no batch_get will come
    assert b.claims_pending() == 0 and hooks.REQUEST_HINTS.get("rid-ended") is None
    no_claims_left(a)


def revoking_cache(backend, handle: CacheRequestHandle, op: PrefetchOperation) -> UnifiedRadixCache:
    """The real cache's revoke path, on a cache holding one prefetch that never got host pages
    (what a hit below prefetch_threshold leaves): no tree, no threads."""
    cc = object.__new__(HybridCacheController)
    cc.storage_backend, cc.prefetch_tokens_occupied = backend, len(op.token_ids)
    cache = object.__new__(UnifiedRadixCache)
    cache.cache_controller, cache.host_memory_mode, cache.buffer_pipeline = cc, "cache", None
    cache._storage_prefetch_hit_remaining_by_reqid = {}
    cache.ongoing_prefetch = {handle: _OngoingPrefetch(anchor_node_id=0, prefetch_key=op.token_ids, host_indices=None,
                                                       operation=op, anchor_lock_params=None, comp_xfers={})}
    return cache


def test_a_revoked_hit_gives_back_the_claims_it_took(backends):
    a, b, pool_b, tokens, keys = stored_pair(backends, 4, seed=250)
    envelope = build_envelope(a.service.control.bound_endpoint, [hash_str_to_int64(k) & U64_MASK for k in keys])
    Scheduler._prefetch_kvcache(idle_scheduler(), request("rid-revoked", envelope))
    op = PrefetchOperation("rid-revoked", tokens, prefix_keys=[])
    op.hash_value, hit = controller(b, pool_b)._storage_hit_query(op)
    assert hit == 4 * PAGE and b.claims_pending() == 1
    handle = CacheRequestHandle("rid-revoked", 0)
    cache = revoking_cache(b, handle, op)
    cache.revoke_pending_prefetch(handle)  # as below prefetch_threshold: no terminate_prefetch first
    assert handle not in cache.ongoing_prefetch and cache.cache_controller.prefetch_tokens_occupied == 0
    assert b.claims_pending() == 0 and hooks.REQUEST_HINTS.get("rid-revoked") is None
    no_claims_left(a)


def test_a_revoked_request_leaves_the_claims_another_request_counts_on(backends):
    a, b, pool_b, tokens, keys = stored_pair(backends, 4, seed=270)
    envelope = build_envelope(a.service.control.bound_endpoint, [hash_str_to_int64(k) & U64_MASK for k in keys])
    cb, ops = controller(b, pool_b), {}
    for rid in ("rid-first", "rid-second"):  # the same prefix: the second counts on the first's claim
        Scheduler._prefetch_kvcache(idle_scheduler(), request(rid, envelope))
        ops[rid] = PrefetchOperation(rid, tokens, prefix_keys=[])
        ops[rid].hash_value, hit = cb._storage_hit_query(ops[rid])
        assert hit == 4 * PAGE
    assert b.claims_pending() == 1
    first = CacheRequestHandle("rid-first", 0)
    revoking_cache(b, first, ops["rid-first"]).revoke_pending_prefetch(first)
    assert b.claims_pending() == 1  # still the second request's
    cb.terminate_prefetch(ops["rid-second"])
    assert b.claims_pending() == 0
    no_claims_left(a)


@pytest.mark.parametrize("argv", [
    ["--hicache-storage-backend", "kvcr"],
    ["--hicache-storage-backend=kvcr", "--hicache-storage-backend-extra-config", '{"claim_lease_s": 3}'],
    ["--hicache-storage-backend", "kvcr", "--hicache-storage-backend-extra-config=@{path}"],
])
def test_the_literal_kvcr_backend_becomes_sglangs_dynamic_backend(tmp_path, argv):
    path = tmp_path / "extra.json"
    path.write_text(json.dumps({"prefetch_timeout_base": 9, "use_posted_hints": False}))
    args = rewrite_args(["--model-path", "some/model", *[a.replace("{path}", str(path)) for a in argv]])
    server_args = prepare_server_args(args)  # SGLang's own parser accepts the result
    assert server_args.hicache_storage_backend == "dynamic" and server_args.enable_hierarchical_cache
    extra = json.loads(server_args.hicache_storage_backend_extra_config)
    assert {k: extra[k] for k in DYNAMIC} == DYNAMIC
    assert extra["hicache_storage_pass_prefix_keys"] is True  # announces chain to their parents
    if "@" in argv[-1]:
        assert extra["prefetch_timeout_base"] == 9 and extra["use_posted_hints"] is False


def test_other_backends_pass_through_unchanged():
    argv = ["--model-path", "m", "--hicache-storage-backend", "file"]
    assert rewrite_args(argv) == argv


def test_a_bad_kvcr_key_is_refused_before_sglang_starts(capsys):
    with pytest.raises(LaunchError, match="unknown key 'lease'"):
        rewrite_args(["--hicache-storage-backend", "kvcr", "--hicache-storage-backend-extra-config", '{"lease": 1}'])
    assert main(["--hicache-storage-backend", "kvcr", "--hicache-storage-backend-extra-config", "{nope"]) == 2
    assert "is not JSON" in capsys.readouterr().err


@pytest.mark.parametrize("version", ["0.5.20", "0.5.24"])
def test_a_release_outside_the_supported_range_is_refused_naming_the_range(monkeypatch, version):
    # A fake version: the releases the table lists are each run live (tests/sglang_live/test_releases.py).
    monkeypatch.setattr(releases.metadata, "version", lambda name: version)
    with pytest.raises(releases.UnsupportedSGLang, match=f"written for sglang 0.5.21 to 0.5.23 .*; this is {version}"):
        hooks.check_version()


def test_a_hooked_function_whose_parameters_changed_under_a_listed_version_is_refused_by_name():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    def terminate_prefetch(self, operation, reason):
        pass
    row = releases.RELEASES["0.5.23"]
    with pytest.raises(releases.UnsupportedSGLang, match=r"HiCacheController.terminate_prefetch\('operation', 'reason'\)"):
        releases.check(row, HiCacheStorage, {"HiCacheController.terminate_prefetch": terminate_prefetch})


def test_a_storage_base_class_unlike_its_releases_row_is_refused():
    class Older:  # no on_host_pools_registered, as before 0.5.23
        pass
    with pytest.raises(releases.UnsupportedSGLang, match="on_host_pools_registered is missing"):
        releases.check(releases.RELEASES["0.5.23"], Older, {})
    releases.check(releases.RELEASES["0.5.21"], Older, {})


def test_the_installed_release_matches_its_row():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    row = releases.installed()
    releases.check(row, HiCacheStorage, {"HiCacheController._storage_hit_query": HiCacheController._storage_hit_query,
                         "HybridCacheController._storage_hit_query": HybridCacheController._storage_hit_query,
                         "HiCacheController.terminate_prefetch": HiCacheController.terminate_prefetch})


def test_without_any_hint_a_backend_finds_the_peer_that_announced_the_pages(backends):
    """Dynamo with stock SGLang workers: nothing forwards a hint, the destination follows its peers."""
    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("page_first", page=PAGE)
    a = backends(pool_a)
    b = backends(pool_b, peers=[a.service.control.bound_endpoint])
    pulled_unhinted(a, pool_a, b, pool_b, first_token=900)


def pulled_unhinted(a, pool_a, b, pool_b, first_token: int) -> None:
    """A backs six pages up; B, asked with no hint, learns them from A's stream and pulls A's bytes."""
    tokens = list(range(first_token, first_token + 6 * PAGE))
    keys = page_hashes(tokens, PAGE)
    src = pool_a.alloc(6 * PAGE)
    fill(pool_a, src, seed=first_token)
    controller(a, pool_a)._page_backup(StorageOperation(src, tokens, hash_value=keys, prefix_keys=[]))
    wait_until(lambda: b.batch_exists(keys) == 6, 10, 0.05, "B learnt A's pages from A's event stream")
    dst = pool_b.alloc(6 * PAGE)
    assert b.batch_get_v1(keys, dst) == [True] * 6
    assert page_bytes(pool_b, dst) == page_bytes(pool_a, src)
    no_claims_left(a)


def _followed(backend) -> dict[str, float]:
    (blocks,) = backend.peering.feed.collect()
    return {s.labels["peer"]: s.value for s in blocks.samples}


@pytest.fixture(params=["peers_dir", "peers_etcd"])
def registry(request, tmp_path):
    """Where the backends find each other: one host's peers directory, or a real etcd."""
    if request.param == "peers_dir":
        return {"peers_dir": str(tmp_path)}
    return {"peers_etcd": request.getfixturevalue("etcd").endpoint}


def test_backends_sharing_a_registry_find_each_other_with_no_list(backends, registry, caplog):
    """No router, no `peers`: each runner leaves its info in the directory (or etcd), the others follow it."""
    caplog.set_level(logging.INFO, logger="sglang_adapter.peers")
    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("page_first", page=PAGE)
    a = backends(pool_a, **registry)
    b = backends(pool_b, **registry)
    mla = backends(mha_pool("page_first", page=PAGE), mla=True, **registry)  # another layout
    pulled_unhinted(a, pool_a, b, pool_b, first_token=1900)
    assert list(_followed(b)) == [a.service.control.bound_endpoint]
    wait_until(lambda: all(f"peer {x.service.control.bound_endpoint} serves another model" in caplog.text
                           for x in (a, b)), 10, 0.05, "the MLA backend saw both entries")
    assert _followed(mla) == {}
    a.close()
    wait_until(lambda: _followed(b) == {}, 10, 0.05, "B forgot A once A left the directory")


def test_a_peers_dir_others_may_write_turns_discovery_off_and_says_why(backends, tmp_path, caplog):
    shared = tmp_path / "peers"
    shared.mkdir()
    shared.chmod(0o777)
    backend = backends(mha_pool("page_first", page=PAGE), peers_dir=str(shared))
    assert backend.peering.registry is None and backend.peering.feed is None
    assert "peers on this host are not discovered" in caplog.text and "writable by others" in caplog.text
    assert list(shared.iterdir()) == []


def test_with_the_launchers_prefetch_timeouts_a_remote_prefetch_loses_no_batch(backends):
    """SGLang drops a batch that completes after its prefetch budget; the launcher's budget must
    cover a remote pull of several 128-page batches (here the scheduler's timeout is a timer)."""
    pages = 300
    pool_a, pool_b = (mha_pool("page_first", page=PAGE, tokens=pages * PAGE + 64) for _ in range(2))
    a, b = backends(pool_a), backends(pool_b)
    tokens = list(range(5000, 5000 + pages * PAGE))
    keys = page_hashes(tokens, PAGE)
    src = pool_a.alloc(pages * PAGE)
    fill(pool_a, src, seed=10)
    assert a.batch_set_v1(keys, src) == [True] * pages
    envelope = build_envelope(a.service.control.bound_endpoint, [hash_str_to_int64(k) & U64_MASK for k in keys])
    Scheduler._prefetch_kvcache(idle_scheduler(), request("rid-budget", envelope))
    cb = controller(b, pool_b)
    op = PrefetchOperation("rid-budget", tokens, prefix_keys=[])
    op.hash_value, hit = cb._storage_hit_query(op)
    assert hit == len(tokens)
    op.host_indices = pool_b.alloc(pages * PAGE)
    budget = TIMEOUTS["prefetch_timeout_base"] + TIMEOUTS["prefetch_timeout_per_ki_token"] * len(tokens) / 1024
    timeout = threading.Timer(budget, op.mark_terminate)
    timeout.start()
    try:
        assert cb._page_transfer(op) == pages and not op.is_terminated()
    finally:
        timeout.cancel()
    assert page_bytes(pool_b, op.host_indices) == page_bytes(pool_a, src)
    hooks.REQUEST_HINTS.pop("rid-budget")


def test_a_sidecar_in_the_extra_config_selects_the_attached_backend():
    args = rewrite_args(["--hicache-storage-backend", "kvcr", "--hicache-storage-backend-extra-config",
                         '{"sidecar": "tcp://127.0.0.1:5600"}'])
    extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
    assert (extra["module_path"], extra["class_name"]) == ("sglang_adapter.sidecar", "KVCRSidecarStorage")


NAMESPACES = [(None, "tenant-a"), ("lora-x", None), ("lora-x", "tenant-a")]


@pytest.mark.parametrize("extra_key, salt", NAMESPACES)
def test_a_namespaced_requests_hint_is_matched_by_its_event_hashes_and_pulls(backends, extra_key, salt):
    """A salted or LoRA page is published under an event hash that is not its storage key's; the
    hint names the former, the lookup is asked for the latter, and the request's tokens join them."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from kvcr.proto.keys import event_hashes, request_page_hashes

    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("page_first", page=PAGE)
    a, b = backends(pool_a), backends(pool_b)
    tokens = list(range(700, 700 + 5 * PAGE))
    keys = request_page_hashes(tokens, PAGE, extra_key=extra_key, cache_salt=salt)
    src = pool_a.alloc(5 * PAGE)
    fill(pool_a, src, seed=7)
    assert a.batch_set_v1(keys, src) == [True] * 5
    events = [e & U64_MASK for e in event_hashes(tokens, PAGE, extra_key=extra_key, cache_salt=salt)]
    assert events != [hash_str_to_int64(k) & U64_MASK for k in keys]  # the two hashes differ
    Scheduler._prefetch_kvcache(idle_scheduler(), request(
        "rid-ns", build_envelope(a.service.control.bound_endpoint, events), tokens, extra_key, salt))
    op = PrefetchOperation("rid-ns", RadixKey(tokens, extra_key=extra_key, cache_salt=salt), prefix_keys=[])
    hashes, hit_tokens = controller(b, pool_b)._storage_hit_query(op)
    assert hashes == keys and hit_tokens == 5 * PAGE and b.claims_pending() == 1
    hooks.REQUEST_HINTS.pop("rid-ns")


@pytest.mark.parametrize("extra_key, salt", NAMESPACES)
def test_a_hint_for_one_namespace_finds_nothing_for_another(backends, extra_key, salt):
    """The hint names tenant-a's pages; the same tokens asked for under another namespace (or
    none) make other keys, so nothing is claimed for them."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from kvcr.proto.keys import event_hashes, request_page_hashes

    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("page_first", page=PAGE)
    a, b = backends(pool_a), backends(pool_b)
    tokens = list(range(900, 900 + 4 * PAGE))
    src = pool_a.alloc(4 * PAGE)
    fill(pool_a, src, seed=9)
    assert a.batch_set_v1(request_page_hashes(tokens, PAGE, extra_key=extra_key, cache_salt=salt), src) == [True] * 4
    envelope = build_envelope(a.service.control.bound_endpoint,
                              [e & U64_MASK for e in event_hashes(tokens, PAGE, extra_key=extra_key, cache_salt=salt)])
    for other_key, other_salt in [(None, None), (extra_key, "tenant-b"), ("lora-y", salt)]:
        Scheduler._prefetch_kvcache(idle_scheduler(), request("rid-other", envelope, tokens, other_key, other_salt))
        op = PrefetchOperation("rid-other", RadixKey(tokens, extra_key=other_key, cache_salt=other_salt),
                               prefix_keys=[])
        _, hit_tokens = controller(b, pool_b)._storage_hit_query(op)
        assert hit_tokens == 0 and b.claims_pending() == 0, (other_key, other_salt)
        hooks.REQUEST_HINTS.pop("rid-other")


def test_dynamos_recorded_envelope_drives_a_pull_end_to_end(backends):
    """tests/data/dynamo_kv_hint.json is the JSON Dynamo's serializer emits for a KvHint (the value
    its own serialization test asserts), used unchanged: the source runner binds the endpoint it
    names, and two pages are given keys whose SGLang event hashes are its block hashes (11, 22)."""
    recorded = json.loads((Path(__file__).parent / "data" / "dynamo_kv_hint.json").read_text())
    source = recorded["actions"][0]["payload"]["source_control_endpoint"]
    pool_a, pool_b = mha_pool("page_first", page=PAGE), mha_pool("page_first", page=PAGE)
    a = backends(pool_a, runner={"dram.size": "4Mi", "runner.control_endpoint": source})
    b = backends(pool_b)
    keys = [f"{h:016x}" + "ab" * 24 for h in recorded["actions"][0]["payload"]["block_hashes"]]
    src = pool_a.alloc(2 * PAGE)
    fill(pool_a, src, seed=12)
    assert a.batch_set_v1(keys, src) == [True, True]
    Scheduler._prefetch_kvcache(idle_scheduler(), request("rid-dynamo", recorded))  # SGLang decodes it
    cb = controller(b, pool_b)
    op = PrefetchOperation("rid-dynamo", list(range(2 * PAGE)), prefix_keys=[])
    op.hash_value, op.host_indices = keys, pool_b.alloc(2 * PAGE)
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(extra_info={"kv_hints": hooks.REQUEST_HINTS.get(
        "rid-dynamo").envelope})) == 2
    assert cb._page_transfer(op) == 2
    assert page_bytes(pool_b, op.host_indices) == page_bytes(pool_a, src)
    hooks.REQUEST_HINTS.pop("rid-dynamo")


def test_a_salted_requests_backup_is_announced_with_the_hashes_the_engine_publishes(backends):
    """The tree's backup spec (real UnifiedTreeCore method over a one-node arena) records the
    node's namespace; the controller's real `_page_backup` then carries it to the backend."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache import unified_tree_core as utc

    from kvcr.proto.keys import event_hashes, storage_namespace_seed

    pool = mha_pool("page_first", page=PAGE)
    backend = backends(pool)
    tokens = list(range(4000, 4000 + 3 * PAGE))
    keys = page_hashes(tokens, PAGE, storage_namespace_seed("lora-x", "salt").hex())
    indices = pool.alloc(3 * PAGE)
    node = SimpleNamespace(backuped=True, hash_value=keys, key=RadixKey(tokens, extra_key="lora-x", cache_salt="salt"),
                           component_data={utc.BASE_COMPONENT_TYPE: SimpleNamespace(host_value=indices)})
    tree = object.__new__(utc.UnifiedTreeCore)
    tree._node_arena, tree.components = {7: node}, []
    spec = tree.build_storage_backup_spec(7, False)
    controller(backend, pool)._page_backup(StorageOperation(spec.host_value, list(spec.token_ids),
                                                            hash_value=spec.hash_value, prefix_keys=[]))
    with backend.runner.lock:
        stored = [e for e in backend.runner.events.inventory() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == event_hashes(tokens, PAGE, extra_key="lora-x",
                                                                      cache_salt="salt")
    assert stored[0].lora_name == "lora-x" and stored[0].cache_salt == "salt"


@pytest.mark.parametrize("extra, host, refused", [
    ({}, ["--host", "0.0.0.0"], True),
    ({}, [], False),  # SGLang's default host is loopback
    ({"runner": {"runner.peers": ["tcp://10.0.0.3:5600"]}}, ["--host", "0.0.0.0"], False),
    ({"runner": {"runner.insecure": True}}, ["--host", "0.0.0.0"], False),
    ({"sidecar": "tcp://127.0.0.1:5600"}, ["--host", "0.0.0.0"], False),  # the sidecar's config decides
])
def test_an_engine_open_to_other_hosts_without_keys_may_not_pull_from_any_hinted_source(extra, host, refused):
    argv = ["--model-path", "m", *host, "--hicache-storage-backend", "kvcr",
            "--hicache-storage-backend-extra-config", json.dumps(extra)]
    if refused:
        with pytest.raises(LaunchError, match="the engine's runner: .*runner.peers = \"\\*\" pulls from"):
            rewrite_args(argv)
    else:
        rewrite_args(argv)


def _events_of(args):
    return json.loads(args[args.index("--kv-events-config") + 1]) if "--kv-events-config" in args else None


def test_by_default_the_engine_publishes_its_events_for_its_runner_to_relay(tmp_path):
    args = rewrite_args(["--model-path", "m", "--hicache-storage-backend", "kvcr"], str(tmp_path))
    events = _events_of(args)
    assert events["endpoint"] == f"ipc://{tmp_path}/events" and events["bind"] is True
    extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["runner"] == {"events.engine_endpoint": events["endpoint"],
                               "events.engine_replay_endpoint": events["replay_endpoint"]}
    server_args = prepare_server_args(args)  # SGLang's own parser takes it
    assert json.loads(server_args.kv_events_config)["replay_endpoint"] == f"ipc://{tmp_path}/replay"


@pytest.mark.parametrize("extra_args", [
    ["--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'],  # the operator's own
    ["--hicache-storage-backend-extra-config", '{"engine_events": false}'],       # turned off
    ["--hicache-storage-backend-extra-config", '{"runner": {"events.engine_endpoint": "tcp://127.0.0.1:9"}}'],
    ["--dp-size", "2"],                                                               # one socket per rank: not yet
    ["--hicache-storage-backend-extra-config", '{"sidecar": "tcp://127.0.0.1:5600"}'],  # the sidecar's config says
])
def test_the_engines_events_are_left_as_the_operator_set_them(tmp_path, extra_args):
    args = rewrite_args(["--model-path", "m", "--hicache-storage-backend", "kvcr", *extra_args], str(tmp_path))
    events = _events_of(args)
    assert events is None or events["endpoint"] == "tcp://*:5557"
    extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
    assert extra.get("runner", {}).get("events.engine_endpoint") in (None, "tcp://127.0.0.1:9")
