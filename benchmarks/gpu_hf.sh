#!/usr/bin/env bash
# One GPU session for dsv4 inside transformers (issue 34): the GPU test (Triton backend's generate() tokens ==
# the torch backend's, official numerics) and bench_hf_generate.py (throughput and cache memory against
# transformers' own cache). Needs transformers >= 5.24.0: if .whl/ holds the wheels (see the device README),
# they are installed to /tmp/site first. Usage (repo root, GPU machine): bash benchmarks/gpu_hf.sh — outputs
# under $OUT.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=src:tests:benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
O=${OUT:-out}; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
python3 -c "import transformers; print('transformers', transformers.__version__)"
timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/hf/test_hf_generate_gpu.py --tb=short \
  > "$O/hf_tests.log" 2>&1
echo "== hf gpu test rc=$?"; grep -E "^E |passed|failed|skipped|Error" "$O/hf_tests.log" | head -20
timeout ${BENCH_S:-300} python3 benchmarks/bench_hf_generate.py ${BENCH_ARGS:-} --out "$O/hf_bench.json" \
  > "$O/hf_bench.log" 2>&1
echo "== hf bench rc=$?"; tail -8 "$O/hf_bench.log"
