#!/usr/bin/env bash
# The release figures in as few GPU calls as possible. Usage (repo root, GPU machine):
#   bash benchmarks/gpu_release.sh run layer tests     call 1: the acceptance run cold then warm, the layer profile,
#                                                      GPU tests of the newest paths
#   bash benchmarks/gpu_release.sh prefix hf ab        call 2: prefix-cache bench, transformers generate() (needs the
#                                                      transformers >= 5.24 wheel in .whl/), old vs new tree A/B
#   ... host | warmup-diag                            decode host path on the GPU | issue 36's key diff
#   ... layer-ab                                       one layer of each kind, the tree in .ab/pre vs this one
#                                                      (PRESET=v4-pro for V4-Pro)
#   ... run-pro                                        the acceptance workload on V4-Pro, once (cold)
#   ... run-ab | step                                  the acceptance run, .ab/pre vs this tree | one prefill step's
#                                                      kernels, idle gaps and host synchronisations
#   ... decode-step                                    the kernels of the acceptance run's graph-replayed decode steps
#   ... smoke                                          the profiling tools on small shapes (and their GPU test)
# Each part writes one log (and JSON) under $OUT (at most 8 files come back from a device call).
export PYTHONPATH=src:tests:benchmarks PYTHONUNBUFFERED=1
O=${OUT:-out}; mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader; date -u
ACCEPT="--preset v4-flash --backend triton --device cuda --requests 64 --prompt-len 8192 --gen-len 256 \
  --no-progress"
for part in "$@"; do
  case $part in
  run)  # issue 36: a fresh Triton cache (cold), then the same run again on it (warm)
    rm -rf /tmp/tc-release
    for t in cold warm; do
      echo "== $t" >> "$O/run.log"
      s=$SECONDS
      check=0; [ $t = warm ] && check=${WARM_CHECK:-0}  # the warm run may also spot-check requests
      timeout ${RUN_S:-230} python3 -m dsv4.cli run $ACCEPT --check-requests $check --triton-cache /tmp/tc-release \
        --json "$O/run_$t.json" >> "$O/run.log" 2>&1
      echo "== run $t rc=$? process wall $((SECONDS - s)) s" | tee -a "$O/run.log"
    done
    grep -E "^== |warm-up|JIT|decode |prefill |total |decode-only|with prefill|first token|first step|CUDA graphs|check|PASS|FAIL" \
      "$O/run.log" ;;
  run-ab)  # the acceptance run on the tree in .ab/pre and on this one, alternating, on one warm Triton cache
    for tree in $(for _ in $(seq ${AB_ROUNDS:-1}); do echo pre new; done); do
      P=src; [ $tree = pre ] && P=.ab/pre/src
      PYTHONPATH=$P timeout ${RUN_S:-230} python3 -m dsv4.cli run $ACCEPT --check-requests 0 \
        --triton-cache /tmp/tc-release --json "$O/run_ab_$tree.json" > "$O/run_ab_$tree.log" 2>&1
      echo "== run $tree rc=$?"; grep -E "^decode |^prefill |decode-only|with prefill" "$O/run_ab_$tree.log"
    done ;;
  step)  # issue 38: where a whole prefill step's time goes (kernels, GPU idle gaps, host synchronisations)
    TRITON_CACHE_DIR=/tmp/tc-release timeout ${STEP_S:-200} python3 benchmarks/profile_step.py --top 16 \
      --json "$O/step.json" 2>&1 | grep -v "warn(" > "$O/step.log"
    echo "== step rc=$?"; cat "$O/step.log" ;;
  decode-step)  # issue 38: the kernels of the acceptance workload's own graph-replayed decode steps
    TRITON_CACHE_DIR=/tmp/tc-release timeout ${STEP_S:-200} python3 benchmarks/profile_decode_step.py --top 24 \
      --json "$O/decode_step.json" 2>&1 | grep -v "warn(\|UserWarning\|_warn_once" > "$O/decode_step.log"
    echo "== decode-step rc=$?"; cat "$O/decode_step.log" ;;
  smoke)  # the profiling tools themselves, small: their GPU test, one layer of each kind, a short prefill profile
    TRITON_CACHE_DIR=/tmp/tc-release timeout ${SMOKE_S:-240} sh -c "python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/bench; python3 benchmarks/profile_layer.py --batch 4 --top 2; python3 benchmarks/profile_layer.py \
      --batch 1 --context 0 --prefill 2048 --top 2; python3 benchmarks/profile_step.py --requests 3 \
      --prompt-len 4096 --top 8 --host-top 8" 2>&1 | grep -v "warn(" > "$O/smoke.log"
    echo "== smoke rc=$?"; grep -E "passed|failed|^(SWA|CSA|HCA)|run, unprofiled|profiled \(|Error" "$O/smoke.log" ;;
  run-pro)  # issue 38: the acceptance workload on V4-Pro, once, on a fresh Triton cache
    rm -rf /tmp/tc-pro
    timeout ${RUN_S:-300} python3 -m dsv4.cli run ${ACCEPT/v4-flash/v4-pro} --triton-cache /tmp/tc-pro \
      --json "$O/run_pro.json" > "$O/run_pro.log" 2>&1
    echo "== run-pro rc=$?"; grep -E "warm-up|JIT|decode |prefill |total |decode-only|first token|first step|CUDA graphs" \
      "$O/run_pro.log" ;;
  host)  # issue 38: the decode step's host path against a real device (layers stood in), with its profile
    TRITON_CACHE_DIR=/tmp/tc-release timeout ${HOST_S:-120} python3 benchmarks/bench_decode_host.py --device cuda \
      --profile 25 --out "$O/host.json" > "$O/host.log" 2>&1
    echo "== host rc=$?"; grep -vE "^\s*$" "$O/host.log" | head -70 ;;
  warmup-diag)  # issue 36: the specialisations the load pass launches that no compile worker launched
    # every eager shape by default (DIAG_REQUESTS="1 2 33 64": only those request counts' shapes)
    TRITON_CACHE_DIR=/tmp/tc-release timeout ${DIAG_S:-300} python3 tools/diag_warmup_launches.py --device cuda \
      --workers 16 ${DIAG_REQUESTS:+--requests $DIAG_REQUESTS} > "$O/warmup_diag.log" 2>&1
    echo "== warmup-diag rc=$?"; head -60 "$O/warmup_diag.log" ;;
  layer-ab)  # one layer of each kind on the tree before this change (.ab/pre) and this one, alternating
    for tree in $(for _ in $(seq ${AB_ROUNDS:-2}); do echo pre new; done); do
      if [ $tree = pre ]; then P=.ab/pre/src; B=.ab/pre/benchmarks; else P=src; B=benchmarks; fi
      PYTHONPATH=$P TRITON_CACHE_DIR=/tmp/tc-ab-$tree timeout ${AB_S:-90} python3 $B/profile_layer.py --batch 64 4 \
        --preset ${PRESET:-v4-flash} --top 12 >> "$O/layer_ab.log" 2>&1
      echo "== layer $tree rc=$?"
    done
    grep -E "^(SWA|CSA|HCA)|^== " "$O/layer_ab.log" ;;
  layer)  # issue 38: one layer of each kind, graph and eager, next to its roofline
    TRITON_CACHE_DIR=/tmp/tc-release timeout ${LAYER_S:-120} python3 benchmarks/profile_layer.py --batch 64 4 \
      --top 6 --json "$O/layer.json" > "$O/layer.log" 2>&1
    echo "== layer rc=$?"; tail -40 "$O/layer.log" ;;
  layer-rule)  # issue 38: the layer with the Triton block GEMM for every FP8 projection of a decode step
    TRITON_CACHE_DIR=/tmp/tc-release timeout ${LAYER_S:-120} python3 benchmarks/profile_layer.py --batch 64 4 \
      --top 8 --triton-gemm-min-values 0 --json "$O/layer_rule.json" > "$O/layer_rule.log" 2>&1
    echo "== layer-rule rc=$?"; grep -E "^(SWA|CSA|HCA)|block_fp8|nvjet|quantize|splitK" "$O/layer_rule.log" | head -40 ;;
  benches)  # the new kernels' own benchmarks: the residual glue, the stacked compressor GEMM, the MXFP4 queries
    TRITON_CACHE_DIR=/tmp/tc-release timeout ${BENCH_S:-180} sh -c "python3 benchmarks/bench_residual_norm.py; \
      python3 benchmarks/bench_compressor_projections.py; python3 benchmarks/bench_mxfp4_queries.py" \
      > "$O/benches.log" 2>&1
    echo "== benches rc=$?"; cat "$O/benches.log" | head -60 ;;
  tests)
    TRITON_CACHE_DIR=/tmp/tc-release timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu \
      ${TESTS:-tests/engine/test_warmup.py tests/kernels/project/test_fp8_projections.py \
      tests/reliability/test_hardening.py tests/cache/test_step_batch_graph.py} --tb=short > "$O/tests.log" 2>&1
    echo "== tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$O/tests.log" | tail -20 ;;
  prefix)
    TRITON_CACHE_DIR=/tmp/tc-release timeout ${PREFIX_S:-200} python3 benchmarks/bench_prefix_cache.py \
      --out "$O/prefix.json" > "$O/prefix.log" 2>&1
    echo "== prefix rc=$?"; tail -16 "$O/prefix.log" ;;
  hf)
    if ls .whl/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    fi
    (export PYTHONPATH=$PYTHONPATH:/tmp/site TRITON_CACHE_DIR=/tmp/tc-release
     python3 -c "import transformers; print('transformers', transformers.__version__)"
     timeout ${HF_TEST_S:-100} python3 -m pytest -q -p no:cacheprovider -m gpu tests/hf/test_hf_generate_gpu.py \
       --tb=short > "$O/hf.log" 2>&1
     echo "== hf test rc=$?"
     timeout ${HF_BENCH_S:-120} python3 benchmarks/bench_hf_generate.py --quick --out "$O/hf.json" >> "$O/hf.log" 2>&1
     echo "== hf bench rc=$?")
    grep -E "^E |passed|failed|skipped|Error" "$O/hf.log" | head; tail -8 "$O/hf.log" ;;
  ab)  # issue 33: the attention kernels of the old tree (.ab/old_src) and this one, alternating, one device
    mkdir -p /tmp/ab
    for tree in old new old new; do
      if [ $tree = old ]; then P=.ab/old_src:.ab/old_benchmarks; B=.ab/old_benchmarks; else P=src:benchmarks; B=benchmarks; fi
      PYTHONPATH=$P TRITON_CACHE_DIR=/tmp/tc-ab-$tree timeout ${AB_S:-60} python3 $B/bench_attention.py --quick \
        --json "/tmp/ab/ab_${tree}_$((++n)).json" >> "$O/ab.log" 2>&1
      echo "== attention $tree rc=$?"
    done
    python3 benchmarks/ab_table.py /tmp/ab | tee -a "$O/ab.log" ;;
  esac
done
