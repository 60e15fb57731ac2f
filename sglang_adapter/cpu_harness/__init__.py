"""Development only: real SGLang 0.5.23 engines with kvcr's backend on a machine without a GPU.

Used by the live tests (tests/sglang_live) and `kvcr demo --engine sglang`; never on the path a
GPU deployment takes. `site/` goes on the engine's PYTHONPATH and patches, in every SGLang
process, only what assumes CUDA (pinned host memory, device<->host copies of the host pool,
torch.cpu.Stream); the storage backend, cache controller and scheduler run unpatched. `model`
builds a tiny random Llama locally; `server` starts and stops engines (docs/sglang.md).
"""
