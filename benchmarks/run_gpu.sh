#!/usr/bin/env bash
# The one command for the GPU machine (see ../shared/gpu/README.md), from the repo root,
# with `.whl` (and `.peers` for benchmarks) carried along:
#   bash benchmarks/run_gpu.sh tests            GPU tests (correctness), log in $OUT
#   bash benchmarks/run_gpu.sh decode [args]    benchmarks/decode.py
#   bash benchmarks/run_gpu.sh prefill [args]   benchmarks/prefill.py
#   bash benchmarks/run_gpu.sh host | e2e       benchmarks/host.py, e2e.py (JSON in $OUT)
#   bash benchmarks/run_gpu.sh memcheck | racecheck | synccheck
#                                               GPU tests under compute-sanitizer (below)
# Several can be chained: bash benchmarks/run_gpu.sh tests decode
set -uo pipefail
OUT=${OUT:-/tmp/attnlang-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export ATTNLANG_CACHE_DIR=${ATTNLANG_CACHE_DIR:-/tmp/attnlang-cache}
export ATTNLANG_ERROR_LOG=$OUT/max_errors.json
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
status=0
for what in "$@"; do
  case "$what" in
    tests) python3 -m pytest -q -ra -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
           status=$((status | PIPESTATUS[0])) ;;
    decode|prefill) python3 "benchmarks/$what.py" --out "$OUT/$what.json" 2>&1 | tee "$OUT/$what.log"
           status=$((status | PIPESTATUS[0])) ;;
    host|e2e) python3 "benchmarks/$what.py" --out "$OUT" 2>&1 | tee "$OUT/$what.log"
           status=$((status | PIPESTATUS[0])) ;;
    memcheck|racecheck|synccheck)
           # Every kernel kind (decode, prefill on wgmma and mma.sync, merge) on the zoo's
           # matrix: 81 tests, ~2-3 min per tool. SANITIZE_K="expr" narrows them (pytest -k).
           sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
           select=()
           [ -n "${SANITIZE_K:-}" ] && select=(-k "$SANITIZE_K")
           "$sanitizer" --tool "$what" --error-exitcode 99 --print-limit 20 \
             python3 -m pytest -q -ra -p no:cacheprovider -m gpu "${select[@]}" \
             tests/runtime/test_gpu_attention.py::test_attention_matches_reference \
             tests/runtime/test_gpu_prefill.py::test_mma_sync_path_on_hopper \
             tests/runtime/test_gpu_prefill.py::test_mixed_decode_and_prefill_batch \
             tests/runtime/test_gpu_attention.py::test_merge_states_matches_numpy \
             2>&1 | tee "$OUT/$what.log" | tail -25
           status=$((status | PIPESTATUS[0])) ;;
    *) echo "unknown step '$what'"; exit 2 ;;
  esac
done
exit $status
