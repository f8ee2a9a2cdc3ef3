#!/usr/bin/env bash
# One GPU session for sparse attention (issue 6): the GPU tests of the chosen kernel variants against the torch
# backend, then the --quick benchmark of the Triton kernel and the default (Gluon on sm_90) side by side.
# Usage (repo root, GPU machine): bash benchmarks/gpu_attention.sh — outputs under $OUT.
#   VARIANTS=default,triton  test variants (tests/kernels/attention/test_attention_gpu.py VARIANTS names)
#   BENCH='[{"impl": "triton"}, {}]'  benchmark variants; ONLY=flash_csa:64,pro_csa  benchmark shapes
#   TESTS=0 skips the tests
export PYTHONPATH=src:tests:benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
O=${OUT:-out}; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
A=tests/kernels/attention/test_attention_gpu.py
[ "${TESTS:-1}" = 0 ] || DSV4_ATTN_VARIANTS=${VARIANTS:-default,triton} timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu "$A" \
  --tb=short -k "${TESTS_K:-not layer_triton}" > "$O/attn_tests.log" 2>&1
echo "== attention tests rc=$?"; grep -E "^E |passed|failed|Error|FAILED" "$O/attn_tests.log" | head -30
DEFAULT_BENCH='[{"impl": "triton"}, {}]'
timeout ${BENCH_S:-300} python3 benchmarks/bench_attention.py --quick --variants "${BENCH:-$DEFAULT_BENCH}" \
  ${ONLY:+--only "$ONLY"} \
  --json "$O/attn_bench.json" > "$O/attn_bench.log" 2>&1
echo "== attention bench rc=$?"; grep -v '^ *$' "$O/attn_bench.log" | tail -45
