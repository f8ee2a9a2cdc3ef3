#!/usr/bin/env bash
# One GPU session for prefix caching (issue 37): the GPU tests (a hit with the Triton backend is bit-identical to a
# cold run: tiny, all layers; V4-Flash, each layer kind; a Triton step with prefix captures makes no host sync),
# then the benchmark (64 requests sharing a 4K system prompt + 1K tokens each, V4-Flash, Triton, with and without
# prefix caching; its table, per-step medians and acceptance lines).
# Usage (repo root, GPU machine): bash benchmarks/gpu_prefix_cache.sh — outputs under $OUT.
export PYTHONPATH=src:tests:benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
O=${OUT:-out}; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
timeout ${TEST_S:-420} python3 -m pytest -q -p no:cacheprovider -m gpu tests/cache/test_prefix_cache_gpu.py tests/cache/test_capture_index.py --tb=short \
  > "$O/prefix_tests.log" 2>&1
echo "== prefix cache GPU tests rc=$?"; grep -E "^E |passed|failed|Error" "$O/prefix_tests.log" | head -30
timeout ${BENCH_S:-540} python3 benchmarks/bench_prefix_cache.py --out "$O/prefix_cache.json" \
  > "$O/prefix_bench.log" 2>&1
echo "== prefix cache bench rc=$?"; tail -30 "$O/prefix_bench.log"
