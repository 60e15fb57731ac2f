#!/usr/bin/env bash
# On a GPU machine: two stock SGLang 0.5.23 engines (CUDA, nothing patched) with
# `--hicache-storage-backend kvcr`, live tests 1-2 against them, and the TTFT bench.
#   bash bench/gpu_smoke.sh            (from the repo root, with .venv holding CUDA torch + sglang 0.5.23)
# KVCR_LIVE_GPU=1 makes sglang_adapter.cpu_harness start engines without its CPU patches and flags.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
export KVCR_LIVE_GPU=1 PYTHONUNBUFFERED=1
"$PY" -m pytest -q -p no:cacheprovider tests/sglang_live/test_backup_and_hits.py tests/sglang_live/test_peer_reuse.py \
    2>&1 | tee "$OUT/gpu-live-tests.log"
"$PY" bench/sglang_live.py --tokens 2048 8192 --repeats 3 --no-write 2>&1 | tee "$OUT/gpu-ttft.log"
