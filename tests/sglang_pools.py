"""Real SGLang 0.5.23 host pools on the CPU, small (shared by the adapter tests and benches)."""

from __future__ import annotations

import sglang_adapter.torchvision_stub as _stub

_stub.install()

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

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
