"""Four small hooks into SGLang (0.5.21 to 0.5.23, releases.py) that stock SGLang lacks, installed by the launcher
(`python -m sglang_adapter.launch_server`) in every scheduler process:

1. request hints: a request's `kv_hints` reach the storage calls made for it (`extra_info`);
2. tokens on backup: `batch_set_v1` gets the pages' token ids, parent key, extra key and salt,
   so stored pages are announced to routers with the hashes the engine itself publishes;
3. prefetch ended: when the scheduler stops a prefetch, or revokes its hit (below
   `prefetch_threshold`, anchor lost), the backend gives back the claims the prefetch will not
   collect;
4. engine hits: the pages a request finds in the engine's own pools are touched in the runner,
   whose LRU would otherwise see only the pages that come to it.

Each wraps one or two methods (the hint hook: the scheduler's prefetch and the controllers' hit
queries; the end hook: terminate and revoke); they are version-gated because they touch internals.
"""

from __future__ import annotations

import functools
import os
import threading
from array import array
from collections import OrderedDict

from .pagemeta import HintedRequest, RequestNamespace
from .releases import check, installed

MAX_TRACKED_REQUESTS = 10_000


def check_version() -> str:
    return installed().version


class RequestHints:
    """rid -> the request's hints (envelope, namespace, tokens), bounded, oldest dropped first."""

    def __init__(self, cap: int = MAX_TRACKED_REQUESTS) -> None:
        self._by_rid: OrderedDict[str, HintedRequest] = OrderedDict()
        self._lock = threading.Lock()
        self.cap = cap

    def put(self, rid: str, hinted: HintedRequest) -> None:
        with self._lock:
            self._by_rid[rid] = hinted
            self._by_rid.move_to_end(rid)
            while len(self._by_rid) > self.cap:
                self._by_rid.popitem(last=False)

    def get(self, rid: str) -> HintedRequest | None:
        with self._lock:
            return self._by_rid.get(rid)

    def pop(self, rid: str) -> None:
        with self._lock:
            self._by_rid.pop(rid, None)


REQUEST_HINTS = RequestHints()
_context = threading.local()  # the hints of the request whose storage call runs on this thread


def current_hints() -> HintedRequest | None:
    return getattr(_context, "hints", None)


def current_request() -> str | None:
    """The id of the request whose hit query runs on this thread (None outside one)."""
    return getattr(_context, "request_id", None)


def _with_request_hints(method):
    """Run a hit query with its operation's request hints visible to the backend's batch_exists
    (batch_get_v1 needs none: it collects the claims batch_exists took)."""
    @functools.wraps(method)
    def wrapper(self, operation, *args, **kwargs):
        _context.hints = REQUEST_HINTS.get(operation.request_id)
        _context.request_id = operation.request_id
        try:
            return method(self, operation, *args, **kwargs)
        finally:
            _context.hints = _context.request_id = None
    return wrapper


def _record_request_hints(method):
    @functools.wraps(method)
    def wrapper(self, req, *args, **kwargs):
        if req.kv_hints is not None:
            REQUEST_HINTS.put(req.rid, hinted_request(req))
        return method(self, req, *args, **kwargs)
    return wrapper


def hinted_request(req) -> HintedRequest:
    """What the backend needs of a hinted request. A namespaced one keeps its tokens (origin and
    output: what the prefetch hashes) because its storage keys are not its event hashes."""
    import msgspec

    ns = RequestNamespace(req.extra_key, req.cache_salt)
    tokens = None
    if not ns.plain:
        tokens = array("q", req.origin_input_ids)
        tokens.extend(req.output_ids)
    return HintedRequest(msgspec.to_builtins(req.kv_hints), ns, tokens)


def _touch_engine_hits(method):
    """A prefix the engine serves from its own device or host pool never reaches the backend: tell
    it here, so the runner's LRU ages the pages the engine no longer uses, not the ones it does."""
    @functools.wraps(method)
    def wrapper(self, req, *args, **kwargs):
        result = method(self, req, *args, **kwargs)
        if not self.enable_hicache_storage:  # no storage backend to tell (nor a match made here)
            return result
        controller = getattr(self.tree_cache, "cache_controller", None)  # a HiCache tree only
        used = getattr(getattr(controller, "storage_backend", None), "engine_hit", None)  # kvcr's only
        if used is not None:
            keys = _matched_page_keys(self.tree_cache, req)
            if keys:
                used(keys)
        return result
    return wrapper


def _matched_page_keys(tree_cache, req) -> list[str]:
    """The storage keys of the pages the request matched in the engine (root first)."""
    node = req.last_host_node
    if tree_cache.is_root(node):  # buffer mode backs nothing up to host: the device match anchors
        node = req.last_node
    if tree_cache.is_root(node):
        return []
    return [*tree_cache.get_prefix_hash_values(node), *tree_cache.tree_core.get_hash_values(node)]


# A backed-up node's first page hash -> its request namespace (extra key, salt): the backup
# operation carries bare token ids, the tree's node still knows them.
BACKUP_NAMESPACES: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()
_namespaces_lock = threading.Lock()


def _record_backup_namespace(method):
    @functools.wraps(method)
    def wrapper(self, node_id, *args, **kwargs):
        spec = method(self, node_id, *args, **kwargs)
        if spec is not None and spec.hash_value:
            # prefetch_anchor_info: the one node query both tree cores (Python and Rust) answer
            extra_key, cache_salt = self.prefetch_anchor_info(node_id)
            if extra_key is not None or cache_salt is not None:
                with _namespaces_lock:
                    BACKUP_NAMESPACES[spec.hash_value[0]] = (extra_key, cache_salt)
                    while len(BACKUP_NAMESPACES) > MAX_TRACKED_REQUESTS:
                        BACKUP_NAMESPACES.popitem(last=False)
        return spec
    return wrapper


def _with_backup_tokens(method):
    """`_page_backup`: remember each page's tokens, the chain's parent and the request's namespace
    for `_page_set_zero_copy`."""
    @functools.wraps(method)
    def wrapper(self, operation, *args, **kwargs):
        p = getattr(self, "storage_page_size", None) or self.page_size  # span mode: SGLang after 0.5.23
        tokens = list(operation.token_ids)
        with _namespaces_lock:
            ns = BACKUP_NAMESPACES.pop(operation.hash_value[0], (None, None)) if operation.hash_value else (None, None)
        _context.backup = ({h: tokens[i * p:(i + 1) * p] for i, h in enumerate(operation.hash_value)},
                           {h: (operation.hash_value[i - 1] if i else _parent(operation))
                            for i, h in enumerate(operation.hash_value)}, ns)
        try:
            return method(self, operation, *args, **kwargs)
        finally:
            _context.backup = None
    return wrapper


def _parent(operation) -> str | None:
    if operation.prefix_keys:
        return operation.prefix_keys[-1]
    return operation.last_hash


def _add_backup_tokens(method):
    @functools.wraps(method)
    def wrapper(self, hash_values, host_indices, extra_info=None):
        backup = getattr(_context, "backup", None)
        if backup is not None and all(h in backup[0] for h in hash_values):
            from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

            info = extra_info or HiCacheStorageExtraInfo()
            extra = dict(info.extra_info or {})
            extra["token_ids"] = [t for h in hash_values for t in backup[0][h]]
            extra["parent_key"] = backup[1][hash_values[0]]
            extra["extra_key"], extra["cache_salt"] = backup[2]
            info.extra_info = extra
            extra_info = info
        return method(self, hash_values, host_indices, extra_info)
    return wrapper


def _end_prefetch(controller, operation) -> None:
    """Claims at peers for pages this prefetch will not read go back now, not at their lease end."""
    REQUEST_HINTS.pop(operation.request_id)
    ended = getattr(controller.storage_backend, "prefetch_ended", None)  # only kvcr's backend listens
    if ended is not None:
        ended(list(operation.all_hash_values or operation.hash_value or []), operation.request_id)


def _notify_prefetch_ended(method):
    @functools.wraps(method)
    def wrapper(self, operation):
        result = method(self, operation)
        _end_prefetch(self, operation)
        return result
    return wrapper


def _notify_prefetch_revoked(method):
    # A hit below prefetch_threshold (or an anchor lost) is revoked without terminate_prefetch.
    @functools.wraps(method)
    def wrapper(self, request):
        info = self.ongoing_prefetch.get(request)
        result = method(self, request)
        if info is not None:
            _end_prefetch(self.cache_controller, info.operation)
        return result
    return wrapper


def _signal_pools_registered(method):
    """Before 0.5.23 nothing tells the backend that every host pool is registered (a hybrid model's
    side pools come after its KV pool). The hooks install while the controller attaches the backend,
    too late to wrap that call; the scheduler's event loop starts once all of it is done."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        controller = getattr(self.tree_cache, "cache_controller", None)  # a HiCache tree only
        registered = getattr(getattr(controller, "storage_backend", None), "on_host_pools_registered", None)
        if registered is not None:  # kvcr's backends
            registered()
        return method(self, *args, **kwargs)
    return wrapper


_installed = False


def install_if_launched() -> None:
    """In an engine started by the launcher (KVCR_SGLANG_HOOKS=1, inherited by every scheduler):
    install the hooks. Each backend module calls it on import, as SGLang loads it in a scheduler."""
    if os.environ.get("KVCR_SGLANG_HOOKS") == "1":
        install()


def _rust_tree_core() -> tuple[type, ...]:
    """SGLang's Rust tree core, where its extension loads (SGLang falls back to the Python core
    where it does not, and so do we)."""
    try:
        from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
    except Exception:  # noqa: BLE001 - a missing or unbuildable extension: the Python core serves
        return ()
    return (RustUnifiedTreeCore,)


def install() -> None:
    """Idempotent. Raises UnsupportedSGLang on any other SGLang release."""
    global _installed
    if _installed:
        return
    release = installed()
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    check(release, HiCacheStorage, {"Scheduler._prefetch_kvcache": Scheduler._prefetch_kvcache,
                                    "Scheduler.run_event_loop": Scheduler.run_event_loop,
                    "UnifiedTreeCore.build_storage_backup_spec": UnifiedTreeCore.build_storage_backup_spec,
                    "UnifiedTreeCore.prefetch_anchor_info": UnifiedTreeCore.prefetch_anchor_info,
                    "HiCacheController._storage_hit_query": HiCacheController._storage_hit_query,
                    "HybridCacheController._storage_hit_query": HybridCacheController._storage_hit_query,
                    "HiCacheController._page_backup": HiCacheController._page_backup,
                    "HiCacheController._page_set_zero_copy": HiCacheController._page_set_zero_copy,
                    "HiCacheController.terminate_prefetch": HiCacheController.terminate_prefetch,
                    "UnifiedRadixCache.revoke_pending_prefetch": UnifiedRadixCache.revoke_pending_prefetch})
    Scheduler._prefetch_kvcache = _touch_engine_hits(_record_request_hints(Scheduler._prefetch_kvcache))
    for core in (UnifiedTreeCore, *_rust_tree_core()):  # engines run the Rust one where it loads
        core.build_storage_backup_spec = _record_backup_namespace(core.build_storage_backup_spec)
    for cls in (HiCacheController, HybridCacheController):
        cls._storage_hit_query = _with_request_hints(cls._storage_hit_query)
    HiCacheController._page_backup = _with_backup_tokens(HiCacheController._page_backup)
    HiCacheController._page_set_zero_copy = _add_backup_tokens(HiCacheController._page_set_zero_copy)
    HiCacheController.terminate_prefetch = _notify_prefetch_ended(HiCacheController.terminate_prefetch)
    UnifiedRadixCache.revoke_pending_prefetch = _notify_prefetch_revoked(UnifiedRadixCache.revoke_pending_prefetch)
    if not release.signals_pools_registered:
        Scheduler.run_event_loop = _signal_pools_registered(Scheduler.run_event_loop)
    _installed = True
