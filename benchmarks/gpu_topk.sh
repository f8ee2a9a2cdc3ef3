#!/usr/bin/env bash
# One GPU session for the top-k alone: its GPU tests (the "bisect" and "filter" algorithms: long rows, ties, reused
# scratch, through the indexer), every TOPK_LAUNCHES entry on decode steps of 8 / 64 / 128 requests at 8K–128K context
# (benchmarks/bench_indexer.py --topk-only), and an ncu profile (per-SASS stall samples) of the "filter" kernel at
# 64 rows x 32K (gpu_profile.sh's "topk" target; PROFILE=0 skips it).
# Usage (repo root, GPU machine): bash benchmarks/gpu_topk.sh — outputs under $OUT (default ./out).
export PYTHONPATH=src:tests:benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
O=${OUT:-out}; mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/indexer/test_indexer_kernels.py --tb=short -k "bisect or filter" > "$O/t.log" 2>&1
echo "tests rc=$?"; grep -E "^E |passed|failed|Error" "$O/t.log" | head -20
timeout 200 python3 benchmarks/bench_indexer.py --topk-only --json "$O/topk.json" > "$O/b.log" 2>&1
echo "bench rc=$?"; grep -E "graph\]" "$O/b.log" | cut -c1-80
grep -i "wrong\|error" "$O/b.log" | head
[ "${PROFILE:-1}" = 1 ] && TARGETS=topk bash benchmarks/gpu_profile.sh
