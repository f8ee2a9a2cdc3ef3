#!/usr/bin/env bash
# One GPU session for the write path: its GPU tests (reduction orders, the long-prefill CSA decode case, graph
# replays, mixed prefill + speculative decode, prefill chunks), the byte locator diagnostic on that CSA case, and
# the --quick benchmark. Usage (repo root, GPU machine): bash benchmarks/gpu_write.sh — outputs under $OUT.
export PYTHONPATH=src:tests:benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
O=${OUT:-out}; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
W=tests/kernels/write/test_write_path_gpu.py
timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu "$W" --tb=short \
  -k "${TESTS_K:-order or 256-csa or graph or mixed or 16-hca or 3-csa}" > "$O/write_tests.log" 2>&1
echo "== write tests rc=$?"; grep -E "^E |passed|failed|Error" "$O/write_tests.log" | head -30
timeout ${DIAG_S:-120} python3 tools/diag_write_locate.py 256 > "$O/write_locate.log" 2>&1
echo "== locate rc=$?"; grep -E "^step" "$O/write_locate.log" | grep -v identical
timeout ${BENCH_S:-240} python3 benchmarks/bench_write.py --quick --json "$O/write_bench.json" > "$O/write_bench.log" 2>&1
echo "== write bench rc=$?"; tail -18 "$O/write_bench.log"
