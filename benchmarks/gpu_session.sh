#!/usr/bin/env bash
# One batched GPU session (device time is scarce). Usage, repo root, GPU machine:
#   bash benchmarks/gpu_session.sh tests          every GPU test of the kept paths (junit + log under $OUT)
#   bash benchmarks/gpu_session.sh ab             quick benchmarks, old tree (.ab/old_src) vs this one, alternating
# Outputs under $OUT (default ./out); the Triton cache in .triton-cache is reused while the machine stays warm.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache DSV4_GPU_TEST_TIMEOUT=${DSV4_GPU_TEST_TIMEOUT:-300}
O=${OUT:-out}; mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader; date -u
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "${1:-tests}" in
tests)
  shift
  T=${*:-tests/kernels/write/test_write_path_gpu.py tests/kernels/indexer/test_indexer_kernels.py \
    tests/kernels/attention/test_attention_gpu.py tests/kernels/attention/test_attention_bf16_keys.py \
    tests/kernels/project/test_rms_norm.py tests/kernels/project/test_queries.py tests/engine/test_engine.py \
    tests/layer/test_torch_backend_cuda.py tests/reliability/test_hardening.py tests/cache/test_step_batch_graph.py \
    tests/cache/test_planner.py}
  PYTHONPATH=src:tests timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu $T --durations=12 \
    --junitxml="$O/gpu_tests.xml" > "$O/gpu_tests.log" 2>&1
  echo "== gpu tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$O/gpu_tests.log" | tail -25
  grep -A14 "slowest" "$O/gpu_tests.log" | tail -13 ;;
ab)
  for tree in old new old new; do
    if [ $tree = old ]; then P=.ab/old_src; B=.ab/old_benchmarks; else P=src; B=benchmarks; fi
    for b in attention indexer write; do
      extra=""; [ $b = indexer ] && extra="--no-sweep"
      PYTHONPATH=$P:$B timeout 150 python3 $B/bench_$b.py --quick $extra --json "$O/${b}_${tree}_$((++n)).json" \
        > "$O/${b}_${tree}_$n.log" 2>&1
      echo "== $b $tree rc=$?"
    done
  done
  python3 benchmarks/ab_table.py "$O" ;;
esac
