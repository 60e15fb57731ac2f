"""Real SGLang 0.5.23 host pools on the CPU, small (shared by the adapter tests and benches)."""

from __future__ import annotations

import sglang_adapter.torchvision_stub as _stub

_stub.install()

import ctypes  # noqa: E402
from queue import Queue  # noqa: E402

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvcr.proto.keys import page_hashes  # noqa: E402
from tests.helpers import wait_until  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _ptrs(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(layout: str, *, layers: int = 2, heads: int = 2, dim: int = 8, page: int = 4, tokens: int = 256,
             dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPoolHost:
    k = [torch.zeros(tokens, heads, dim, dtype=dtype) for _ in range(layers)]
    v = [torch.zeros(tokens, heads, dim, dtype=dtype) for _ in range(layers)]
    info = MHABufferInfo(buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=page, head_num=heads, head_dim=dim, v_head_dim=dim, dtype=dtype,
                         device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=page, layout=layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=tokens, start_layer=0,
                                end_layer=layers - 1)


def mla_pool(layout: str, *, layers: int = 2, lora: int = 16, rope: int = 8, page: int = 4, tokens: int = 256,
             dtype: torch.dtype = torch.bfloat16) -> MLATokenToKVPoolHost:
    bufs = [torch.zeros(tokens, 1, lora + rope, dtype=dtype) for _ in range(layers)]
    info = MLABufferInfo(buffers=tuple(bufs), data_ptrs=_ptrs(bufs), layer_indices=tuple(range(layers)),
                         device_layer_num=layers, page_size=page, kv_lora_rank=lora, qk_rope_head_dim=rope,
                         kv_cache_dim=lora + rope, dtype=dtype, device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=page, layout=layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=tokens, start_layer=0,
                                end_layer=layers - 1, target_layer_num=layers)


PAGE = 4
DYNAMIC = {"backend_name": "kvcr", "module_path": "sglang_adapter.storage", "class_name": "KVCRStorage",
           "interface_v1": 1}


def storage_config(mla: bool = False, layout: str = "page_first", **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name="test/model",
                                extra_config={**DYNAMIC, "prefetch_threshold": 256,
                                              # 2 loaded cores can hold a first contact past the 2 s default
                                              "runner": {"dram.size": "4Mi", "runner.control_timeout_s": 10.0},
                                              "peers_dir": "",  # strangers unless a test gives a directory
                                              **extra})


def make_backend(pool, mla: bool = False, **extra):
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(mla, pool.layout, **extra), pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def fill(pool, indices: torch.Tensor, seed: int) -> None:
    """Random bytes into the host pages `indices` covers."""
    gen = torch.Generator().manual_seed(seed)
    for ptrs, size in zip(*pool.get_page_buffer_meta(indices)):
        buf = (torch.ByteTensor(size).random_(0, 256, generator=gen))
        torch.frombuffer((ctypes.c_char * size).from_address(ptrs), dtype=torch.uint8)[:] = buf


def page_bytes(pool, indices: torch.Tensor) -> list[bytes]:
    return [ctypes.string_at(p, s) for p, s in zip(*pool.get_page_buffer_meta(indices))]


def keys_for(n: int, seed: int = 0) -> list[str]:
    return page_hashes([seed * 1000 + i for i in range(n * PAGE)], PAGE)


def no_claims_left(source) -> None:
    """The release after a pull is sent without waiting for the answer: give it a moment."""
    wait_until(lambda: source.runner.claims.statistics().num_claims == 0, 5, 0.02, "the source's claims released")


def controller(backend, pool) -> HiCacheController:
    """The real controller's storage methods, without its threads or a GPU (reference recipe)."""
    cc = object.__new__(HiCacheController)
    cc.storage_backend, cc.page_size, cc.mem_pool_host = backend, pool.page_size, pool
    cc.storage_host_pool = pool
    cc.page_get_func, cc.page_set_func = cc._page_get_zero_copy, cc._page_set_zero_copy
    cc.prefetch_sync_queue = Queue()
    return cc
