"""The CPU harness's patches to SGLang (0.5.21 to 0.5.23), applied as post-import hooks (development
only: sglang_adapter.cpu_harness).

Each replaces code that assumes CUDA and nothing else:
1. `HostKVCache.__init__`: no pinned host memory (cudaHostRegister needs CUDA);
2. `MHATokenToKVPoolHost.backup_from_device_all_layer` / `load_to_device_per_layer`: plain torch
   index copies between the CPU "device" pool and the host pool (the originals call
   sgl_kernel.kvcacheio, imported only on CUDA/HIP/XPU);
3. the same two copies for `MLATokenToKVPoolHost` (one latent buffer per layer instead of K and V);
4. `torch.cpu.Stream.synchronize` / `query`, missing in torch 2.13.0+cpu;
5. MLA models on `torch_native` attention take the absorbed MLA path for every forward: the
   MHA prefill path SGLang picks otherwise is written for CUDA kernels that read K and V from the
   batch, while torch_native reads them from the (latent) cache.
6. 0.5.21's paged token allocator, which launches Triton kernels only: the same allocation in torch.
The storage backend, the cache controller and the scheduler run unpatched.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys


def _token_view(host, buf, layer: int, idx):
    """(view, index) addressing token slots `idx` of one layer of a host K or V buffer."""
    ps = host.page_size
    if host.layout == "layer_first":
        return buf[layer], (idx,)
    if host.layout == "page_first":
        return buf[:, layer], (idx,)
    if host.layout == "page_first_direct":
        return buf[:, layer], (idx // ps, idx % ps)
    if host.layout == "page_head":
        return buf[:, :, :, layer], (idx // ps, slice(None), idx % ps)
    raise NotImplementedError(f"CPU harness: host layout {host.layout}")


def _kv_buffers(host, layer: int) -> list:
    """(host buffer, device buffer) pairs of one layer: K and V. Before 0.5.22 the host pool keeps
    no table of device buffers: they are its device pool's own."""
    if not hasattr(host, "device_k_buffers"):
        return [(host.k_buffer, host.device_pool.k_buffer[layer]), (host.v_buffer, host.device_pool.v_buffer[layer])]
    return [(host.k_buffer, host.device_k_buffers[layer]), (host.v_buffer, host.device_v_buffers[layer])]


def _latent_buffers(host, layer: int) -> list:
    """MLA's one latent buffer of a layer."""
    if not hasattr(host, "device_kv_buffers"):
        return [(host.kv_buffer, host.device_pool.kv_buffer[layer])]
    return [(host.kv_buffer, host.device_kv_buffers[layer])]


def _copy_layer(host, layer: int, host_indices, device_indices, to_host: bool) -> None:
    hidx, didx = host_indices.long().cpu(), device_indices.long().cpu()
    for buf, dev in host.harness_buffers(layer):
        view, index = _token_view(host, buf, layer, hidx)
        if to_host:
            view[index] = dev[didx].to(view.dtype)
        else:
            dev[didx] = view[index].to(dev.dtype)


def _backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
    for layer in range(self.layer_num):
        _copy_layer(self, layer, host_indices, device_indices, to_host=True)


def _load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                              is_draft: bool = False):
    if not is_draft and not 0 <= layer_id < self.target_layer_num:
        return
    _copy_layer(self, layer_id, host_indices, device_indices, to_host=False)


def _patch_base(module) -> None:
    original = module.HostKVCache.__init__
    signature = inspect.signature(original)  # pin_memory is positional before 0.5.22, keyword-only since

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["pin_memory"] = False
        original(*bound.args, **bound.kwargs)
    module.HostKVCache.__init__ = init


def _patch_mha(module) -> None:
    module.MHATokenToKVPoolHost.harness_buffers = _kv_buffers
    module.MHATokenToKVPoolHost.backup_from_device_all_layer = _backup_from_device_all_layer
    module.MHATokenToKVPoolHost.load_to_device_per_layer = _load_to_device_per_layer


def _patch_mla(module) -> None:
    module.MLATokenToKVPoolHost.harness_buffers = _latent_buffers
    module.MLATokenToKVPoolHost.backup_from_device_all_layer = _backup_from_device_all_layer
    module.MLATokenToKVPoolHost.load_to_device_per_layer = _load_to_device_per_layer


class _OnCpu:
    """Stands in for a Triton kernel launched as `kernel[grid](*args)`: the same work in torch."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _alloc_decode_on_cpu(seq_lens, last_loc, free_pages, out_indices, _bs_pow2, page_size) -> None:
    """One slot per request: the next in its last page, or the first of a fresh page (taken from
    `free_pages` in request order) when its new token starts one."""
    import torch  # loaded by then: the allocator imported it

    starts = (seq_lens - 1) % page_size == 0
    if not bool(starts.any()) or free_pages.numel() == 0:
        out_indices.copy_(last_loc + 1)
        return
    rank = (starts.long().cumsum(0) - 1).clamp(min=0, max=free_pages.numel() - 1)
    out_indices.copy_(torch.where(starts, free_pages[rank] * page_size, last_loc + 1))


def _patch_paged_allocator(module) -> None:
    if hasattr(module, "alloc_decode_naive"):  # 0.5.22 on: the allocator has torch paths of its own
        return
    extend = module.alloc_extend_naive
    module.alloc_extend_kernel = _OnCpu(lambda prefix_lens, seq_lens, last_loc, free_pages, out_indices, _bs_pow2,
                                        page_size: extend(prefix_lens, seq_lens, last_loc, free_pages, out_indices,
                                                          page_size, out_indices.device))
    module.alloc_decode_kernel = _OnCpu(_alloc_decode_on_cpu)


def _patch_mla_dispatch(module) -> None:
    module.AttentionBackendRegistry.register("torch_native", module._dispatch_mla_subtype)


def _patch_torch_native(module) -> None:
    # DP attention pads a rank's batch to the group's size; on CPU it asks the attention backend for
    # the padded rows' seq len, which only SGLang's AMX backend (sgl_kernel's CPU ops) answers.
    module.TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1


def _patch_rotary(module) -> None:
    # A DP-attention rank without requests runs an empty (idle) batch in step with the others; the
    # native rotary embedding cannot reshape zero tokens, where CUDA's kernel does nothing.
    native = module.RotaryEmbedding.forward_native

    def forward_native(self, positions, query, key, *args, **kwargs):
        if positions.numel() == 0:
            return query, key
        return native(self, positions, query, key, *args, **kwargs)

    module.RotaryEmbedding.forward_native = forward_native


def _patch_torch(module) -> None:
    stream = module.cpu.Stream
    stream.synchronize = lambda self: None
    stream.query = lambda self: True


def _stub_torchvision(module) -> None:
    from sglang_adapter.torchvision_stub import install

    install()


PATCHES = {
    "torch": _patch_torch,
    "transformers.utils.import_utils": _stub_torchvision,
    "sglang.srt.mem_cache.pool_host.base": _patch_base,
    "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
    "sglang.srt.mem_cache.pool_host.mla": _patch_mla,
    "sglang.srt.models.deepseek_common.attention_backend_handler": _patch_mla_dispatch,
    "sglang.srt.mem_cache.allocator.paged": _patch_paged_allocator,
    "sglang.srt.layers.attention.torch_native_backend": _patch_torch_native,
    "sglang.srt.layers.rotary_embedding.base": _patch_rotary,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _PostImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, patch)
        return spec


def install() -> None:
    if not any(isinstance(f, _PostImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport())
