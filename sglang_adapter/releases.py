"""The SGLang releases kvcr's hooks are written for, and where they differ for the hooks.

Every hooked function keeps one shape across the supported releases except where a row says
otherwise; `check` compares the installed release against its row when the hooks install, so a
release outside the table, or a wheel whose hooked functions changed under the same version, is
refused by name instead of failing inside a scheduler later. How a request carries its hints
(`Req.kv_hints`) and the tree core's backup spec (`StorageBackupSpec.hash_value`) are the same in
all three.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Mapping

# function -> its parameters after `self`, in every supported release unless the release's row says
HOOKED: Mapping[str, tuple[str, ...]] = {
    "Scheduler._prefetch_kvcache": ("req", "storage_hit_end"),
    "Scheduler.run_event_loop": (),
    "UnifiedTreeCore.build_storage_backup_spec": ("node_id", "pass_prefix_keys"),
    "UnifiedTreeCore.prefetch_anchor_info": ("node_id",),
    "HiCacheController._storage_hit_query": ("operation",),
    "HybridCacheController._storage_hit_query": ("operation",),
    "HiCacheController._page_backup": ("operation",),
    "HiCacheController._page_set_zero_copy": ("hash_values", "host_indices", "extra_info"),
    "HiCacheController.terminate_prefetch": ("operation",),
    "UnifiedRadixCache.revoke_pending_prefetch": ("request",),
}


@dataclass(frozen=True, slots=True)
class Release:
    version: str
    # The cache controller tells the backend once every host pool is registered
    # (`HiCacheStorage.on_host_pools_registered`); before 0.5.23 the hooks do, as the scheduler's
    # event loop starts.
    signals_pools_registered: bool
    differs: Mapping[str, tuple[str, ...]]  # hooked functions whose parameters differ from HOOKED


_HYBRID_PP = {"HybridCacheController._storage_hit_query": ("operation", "pp_rank")}
RELEASES: Mapping[str, Release] = {
    "0.5.21": Release("0.5.21", signals_pools_registered=False, differs=_HYBRID_PP),  # Dynamo 1.6.1's pin
    "0.5.22": Release("0.5.22", signals_pools_registered=False, differs=_HYBRID_PP),
    "0.5.23": Release("0.5.23", signals_pools_registered=True, differs={}),
}
SUPPORTED = tuple(RELEASES)


class UnsupportedSGLang(RuntimeError):
    pass


def installed() -> Release:
    """The installed SGLang's row; UnsupportedSGLang names the supported range for anything else."""
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise UnsupportedSGLang("sglang is not installed") from None
    release = RELEASES.get(version)
    if release is None:
        raise UnsupportedSGLang(f"kvcr's SGLang hooks are written for sglang {SUPPORTED[0]} to {SUPPORTED[-1]} "
                                f"({', '.join(SUPPORTED)}); this is {version}. Use `--hicache-storage-backend dynamic` "
                                "with kvcr's extra-config (no hooks: posted hints only, pages not announced) or a "
                                "supported release")
    return release


def check(release: Release, storage_base: type, functions: Mapping[str, Callable]) -> None:
    """The release's row holds: SGLang's storage base class (`HiCacheStorage`) signals pools
    registered or not as it says, and each hooked function (by the names in HOOKED) has the
    parameters it says."""
    if signals_pools_registered(storage_base) != release.signals_pools_registered:
        raise UnsupportedSGLang(f"sglang {release.version}: HiCacheStorage.on_host_pools_registered is "
                                f"{'missing' if release.signals_pools_registered else 'there'}, unlike the release "
                                "kvcr's hooks were written for (a modified SGLang?)")
    for name, fn in functions.items():
        want = release.differs.get(name, HOOKED[name])
        got = tuple(inspect.signature(fn).parameters)[1:]
        if got != want:
            raise UnsupportedSGLang(f"sglang {release.version}: {name}{got} is not the {name}{want} kvcr's hooks "
                                    "were written for (a modified SGLang?)")


def signals_pools_registered(storage_base: type) -> bool:
    """Whether SGLang's storage base class (`HiCacheStorage`) is told when every host pool is registered."""
    return "on_host_pools_registered" in vars(storage_base)
