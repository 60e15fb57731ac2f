"""Test-only stand-in for `sgl_kernel` (no CPU build of it exists on the registry).

With SGLANG_USE_CPU_ENGINE=1, SGLang imports kernels from it at module load; only the request-to-token
assignment below is given a body, the rest raise when called (the torch-native path never calls them). It registers nothing under torch.ops.sgl_kernel (so AMX
support reads False and every layer takes forward_native) and has no submodules.
"""

import torch


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, width):
    """req_to_token[row, start:end] = the next slots of out_cache_loc, request by request."""
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[at:at + end - start]
        at += end - start


def copy_all_layer_kv_cache_cpu(*args, **kwargs):
    raise NotImplementedError("sgl_kernel stand-in: copy_all_layer_kv_cache_cpu is not used on the CPU test path")


def __getattr__(name: str):
    """Any other kernel SGLang imports at module load on CPU (speculative trees, ...) imports fine and
    raises when called: the harness's tiny model never reaches them."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in (kvcr's CPU test harness) has no {name}")
    missing.__name__ = name
    return missing
