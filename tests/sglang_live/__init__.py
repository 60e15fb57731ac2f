"""Live tests: real `sglang.launch_server` engines with kvcr's backend (sglang_adapter.cpu_harness)."""
