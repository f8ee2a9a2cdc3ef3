#!/usr/bin/env bash
# One GPU session for the lightning indexer: its GPU tests (scores + every top-k algorithm), the --quick benchmark
# (top-k algorithms eager and as graph replays) and an ncu profile (per-SASS stall samples) of the "filter" top-k at
# 64 rows × 32K (gpu_profile.sh's "topk" target; only with PROFILE=1).
# Usage (repo root, GPU machine): bash benchmarks/gpu_indexer.sh — outputs under $OUT (default ./out).
# TESTS_K: a pytest -k expression selecting the GPU tests (default: all of them).
export PYTHONPATH=src:tests:benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
O=${OUT:-out}; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git rev-parse --short HEAD 2>/dev/null
I=tests/kernels/indexer/test_indexer_kernels.py
timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu "$I" --tb=short ${TESTS_K:+-k "$TESTS_K"} \
  > "$O/idx_tests.log" 2>&1
echo "== indexer tests rc=$?"; grep -E "^E |passed|failed|Error" "$O/idx_tests.log" | head -20
timeout ${BENCH_S:-200} python3 benchmarks/bench_indexer.py --quick --no-sweep --json "$O/indexer.json" > "$O/idx_bench.log" 2>&1
echo "== indexer bench rc=$?"; grep -v '^ *$' "$O/idx_bench.log" | tail -45
[ "${PROFILE:-0}" = 1 ] || exit 0
TARGETS=topk bash benchmarks/gpu_profile.sh
