"""What an in-process runner is built from: one KeyLayout per SGLang host pool, and the runner's
config forced from SGLang's storage config (page size, namespace, pools sized alike)."""

from __future__ import annotations

from kvcr.config import Config, load_config
from kvcr.ranks import for_rank

from .config import AdapterConfig
from .dp import DpPlacement
from .layout import KeyLayout, PageLayout

POOL = "kv"


def key_layout(pool, layouts: dict[str, KeyLayout], storage_page_size: int | None) -> KeyLayout:
    """What one storage key holds of `pool` (KV and KV-derived pools a span of pages per key;
    state pools, as Mamba's, one slot)."""
    page = PageLayout.of(pool)
    kv_page = layouts[POOL].page.page_size if POOL in layouts else page.page_size
    span = (storage_page_size or kv_page) // kv_page
    if storage_page_size and storage_page_size % kv_page:
        raise ValueError(f"kvcr: storage_page_size {storage_page_size} is not a multiple of the page size {kv_page}")
    return KeyLayout(page, span if page.page_size == kv_page else 1)


def runner_config(storage_config, cfg: AdapterConfig, layouts: dict[str, KeyLayout], *, interface_v1: bool,
                  placement: DpPlacement = DpPlacement()) -> Config:
    """The runner of DP rank `placement.rank`: the extra-config's endpoints and directories are the
    base every rank offsets (kvcr.ranks)."""
    sc, kv = storage_config, next(iter(layouts.values())).page
    model = sc.model_name or cfg.model or "default"
    forced = {"runner.block_size": kv.page_size,
              "runner.pull_timeout_s": cfg.pull_timeout_s, "namespace.model": model,
              "namespace.is_mla": sc.is_mla_model, "namespace.dtype": kv.dtype,
              "namespace.cp_size": sc.attn_cp_size, "namespace.cp_rank": sc.attn_cp_rank,
              # v1 pages are the segments in host-layout order; legacy pages are flat tensors
              "namespace.layout": kv.layout if interface_v1 else f"flat-{kv.layout}",
              "dram.pools": [{"name": name, "page_bytes": lay.bytes} for name, lay in layouts.items()]}
    # "auto": a peer on this host is copied from its pool mapped read-only (UCX emulates GETs
    # over shared memory, at half the speed); peers elsewhere are read with UCX GETs.
    defaults = {"runner.name": "sglang", "runner.peers": ["*"], "runner.transfer": "auto"}
    raw = {**defaults, **cfg.runner, **forced}
    if len(layouts) > 1:  # every pool holds as many keys as the others
        size = load_config(cfg.runner_config or None, raw).dram.size
        keys = size // sum(lay.bytes + 4096 for lay in layouts.values())
        raw["dram.pools"] = [{**p, "size": keys * (lay.bytes + 4096)}
                             for p, lay in zip(raw["dram.pools"], layouts.values())]
    return for_rank(load_config(cfg.runner_config or None, raw), placement.rank, placement.size)
