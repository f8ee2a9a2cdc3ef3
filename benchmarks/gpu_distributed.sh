#!/usr/bin/env bash
# Two-GPU session for the distributed splits (issue 39), on one host with 2 GPUs (NCCL), in two calls of < 10 min:
#   bash benchmarks/gpu_distributed.sh tp   # TP=2: V4-Flash decode step at B=64 x 8K vs one GPU (+ spot checks)
#   bash benchmarks/gpu_distributed.sh cp   # the two-GPU tests, then CP=2: V4-Pro cache per GPU and decode at 1M
# Each prints the benchmark's table (one GPU, two GPUs, ratio, target); logs and JSON under $OUT.
export PYTHONPATH=src:tests:benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
O=${OUT:-out}; mkdir -p "$O"; PART=${1:-tp}
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
if [ "$PART" = cp ]; then
  timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/distributed/test_distributed_ranks_gpu.py \
    --tb=short > "$O/distributed_tests.log" 2>&1
  echo "== distributed GPU tests rc=$?"; grep -E "^E |passed|failed|Error" "$O/distributed_tests.log" | head -20
fi
timeout ${BENCH_S:-$([ "$PART" = tp ] && echo 560 || echo 380)} python3 -m torch.distributed.run --nproc-per-node 2 \
  benchmarks/bench_distributed.py --parts "$PART" --out "$O/distributed_$PART.json" > "$O/distributed_$PART.log" 2>&1
echo "== distributed bench ($PART) rc=$?"; grep -A12 "^dsv4 distributed benchmark" "$O/distributed_$PART.log" || tail -30 "$O/distributed_$PART.log"
