"""A CPU test harness for real `sglang.launch_server` engines with kvcr's backend (tests only).

SGLang 0.5.23 assumes CUDA in three places on the host-cache path's edges; `site/` patches those
in every SGLang process and nothing on the storage path, controller or scheduler (docs/sglang.md).
"""
