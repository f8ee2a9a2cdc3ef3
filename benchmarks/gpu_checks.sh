#!/usr/bin/env bash
# One batched GPU session (device time is scarce): end-to-end smoke with CUDA graphs off/on and the torch backend
# as a control, the write-path cases that failed on the H200, and the indexer / attention variant benchmarks.
# Usage (repo root, GPU machine): bash benchmarks/gpu_checks.sh   — outputs under $OUT (default ./out).
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache  # kept between calls (git-ignored)
O=${OUT:-out}; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
RUN="python3 -m dsv4.cli run --preset v4-flash --layers 0 2 3 --device cuda --requests 4 --prompt-len 1024 --gen-len 16 --no-progress"
for g in off on; do
  timeout 60 $RUN --backend triton --cuda-graphs $g --json "$O/smoke_triton_$g.json" > "$O/smoke_triton_$g.log" 2>&1
  echo "== smoke triton graphs=$g rc=$?"; grep -E "req|spot check|decode |prefill " "$O/smoke_triton_$g.log" | tail -10
done
timeout 50 $RUN --backend torch --cuda-graphs off --json "$O/smoke_torch.json" > "$O/smoke_torch.log" 2>&1
echo "== smoke torch rc=$?"; grep -E "req|spot check" "$O/smoke_torch.log" | tail -8
W=tests/kernels/write/test_write_path_gpu.py
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "$W::test_decode_steps_match_torch[256-hca]" \
  "$W::test_decode_steps_match_torch[64-csa]" "$W::test_prefill_chunks_match_torch[16-hca]" \
  "$W::test_prefill_chunks_match_torch[3-csa]" "$W::test_cuda_graph_replay_matches_eager[csa]" \
  "$W::test_mixed_prefill_and_spec_decode_match_torch" --tb=short > "$O/write.log" 2>&1
echo "== write rc=$?"; grep -E "^E |passed|failed|Error" "$O/write.log" | head -30
timeout 200 python3 benchmarks/bench_write.py --quick --json "$O/write_bench.json" > "$O/write_bench.log" 2>&1
echo "== write bench rc=$?"; tail -16 "$O/write_bench.log"
timeout 90 python3 benchmarks/bench_indexer.py --quick --no-sweep --json "$O/indexer_variants.json" > "$O/idx_bench.log" 2>&1
echo "== indexer bench rc=$?"; grep -v '^ *$' "$O/idx_bench.log" | tail -30
I=tests/kernels/indexer/test_indexer_kernels.py
timeout 40 python3 -m pytest -q -p no:cacheprovider "$I::test_gpu_radix_topk_large" "$I::test_gpu_indexer_topk_variants" > "$O/idx_tests.log" 2>&1
echo "== indexer tests rc=$?"; tail -3 "$O/idx_tests.log"
V='[{}, {"impl": "triton"}, {"impl": "triton", "block_h": 32, "block_n": 32}]'
timeout 130 python3 benchmarks/bench_attention.py --quick --variants "$V" --json "$O/attn_variants.json" > "$O/attn_bench.log" 2>&1
echo "== attention bench rc=$?"; grep -v '^ *$' "$O/attn_bench.log" | tail -40
