#!/usr/bin/env bash
# Hardware-counter profiles (ncu, Firecracker GPU machines) of the write-path kernel (HCA decode B=1 / 256, CSA
# 8K-token prefill), the "filter" top-k (64 rows x 32K) and the sparse-attention kernels (Triton and Gluon) at Flash
# CSA B=64: per-SASS-instruction stall samples as CSV, plus the summary sections.
# Usage (repo root, GPU machine): bash benchmarks/gpu_profile.sh — outputs under $OUT (default ./out); summarise a
# NAME.sass.csv anywhere with python benchmarks/ncu_sass_summary.py.
export PYTHONPATH=src:tests:benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
O=${OUT:-out}; mkdir -p "$O"
NCU="ncu --clock-control none --section SourceCounters --section WarpStateStats --section LaunchStats --section Occupancy --section SpeedOfLight --section InstructionStats --section ComputeWorkloadAnalysis --import-source no"
prof() {  # name, kernel regex, command...
  local name=$1 k=$2; shift 2
  timeout 150 $NCU -k "regex:$k" --launch-skip 2 --launch-count ${COUNT:-1} -f -o "$O/$name" "$@" > "$O/$name.run.log" 2>&1
  echo "== $name rc=$?"
  ncu --import "$O/$name.ncu-rep" --print-details all > "$O/$name.txt" 2>&1
  ncu --import "$O/$name.ncu-rep" --page source --print-source sass --csv > "$O/$name.sass.csv" 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|No Eligible|Stall|Local|Issue Slots|Executed Ipc|Pipe" "$O/$name.txt" | head -30
  wc -c "$O/$name.sass.csv"
}
# TARGETS selects among: write_hca write_hca256 write_csa_prefill hca_prefill swa_prefill (both kernels of the step) csa_entries scores topk attn_csa attn_gluon (default: write_hca and
# the attention ones); BATCH the attention batch (default 64);
# VARIANT the Gluon kernel's sparse_attention_fwd keywords (JSON); KERNELS its kernel-name regex; SHAPE its
# bench_attention shape (default flash_csa); COUNT launches.
GLUON='{"impl": "gluon"}'
for target in ${TARGETS:-write_hca attn_csa attn_gluon}; do
  case $target in
    write_hca) prof write_hca '_write_before' python3 benchmarks/bench_write.py --only "v4-flash hca decode B=1" \
      --profile-calls 4 ;;
    write_hca256) prof write_hca256 '_write_before' python3 benchmarks/bench_write.py \
      --only "v4-flash hca decode B=256" --profile-calls 4 ;;
    write_csa_prefill) prof write_csa_prefill '_write_before' python3 benchmarks/bench_write.py \
      --only "v4-flash csa prefill 8K" --profile-calls 4 ;;
    hca_prefill) COUNT=3 prof hca_prefill '_write_before|_append_swa|_window_entries' python3 benchmarks/bench_write.py \
      --only "v4-flash hca prefill 8K" --profile-calls 3 ;;
    swa_prefill) COUNT=2 prof swa_prefill '_window_entries|_append_swa' python3 benchmarks/bench_write.py \
      --only "v4-flash swa prefill 8K" --profile-calls 3 ;;
    csa_entries) prof csa_entries '_csa_entries' python3 benchmarks/bench_write.py \
      --only "v4-flash csa prefill 8K" --profile-calls 4 ;;
    scores) prof scores '_scores' python3 benchmarks/ab_scores.py --profile-calls 4 ;;
    topk) prof topk '_filter_topk' python3 benchmarks/profile_topk.py --algorithm filter --calls 4 ;;
    attn_csa) prof attn_csa '_sparse_attention_kernel' python3 benchmarks/profile_attention.py --shape flash_csa \
      --batch ${BATCH:-64} --calls 4 ;;
    attn_gluon) prof attn_gluon "${KERNELS:-_sparse_attention_sm90_kernel}" python3 benchmarks/profile_attention.py \
      --shape ${SHAPE:-flash_csa} --batch ${BATCH:-64} --calls 4 --variant "${VARIANT:-$GLUON}" ;;
  esac
done
rm -f "$O"/*.ncu-rep
