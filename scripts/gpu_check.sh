#!/usr/bin/env bash
# The whole GPU check in one device call: build the library for sm_90, run the GPU tests (and the kernel
# tests, natively on CUDA), then the attention and LayerNorm benchmarks. Results in $OUT/gpu_check.tgz.
#
#   ../shared/device/ort-gpu-bundle                 # once, here: writes .ortgpu/
#   mkdir -p .ortinc && cp "$ORT_INCLUDE_DIR"/*.h .ortinc/   # or: ./dev build (fetches into .cache)
#   device run, carry [".ortgpu", ".ortinc"]:  source .ortgpu/activate.sh && bash scripts/gpu_check.sh
# Environment: PYTEST_PATHS (default tests/gpu tests/ops), PYTEST_ARGS (more pytest arguments), BENCH_ARGS
# (for the LayerNorm benchmark), LN_CANDIDATES (below), SWEEPS=1 (also the launch-config sweeps behind
# ops/layer_norm.py and ops/attention.py), BENCH=0 (skip the benchmarks), ATTENTION_BENCH=0 (only the
# LayerNorm one), SANITIZE=1 (compute-sanitizer; SANITIZE_TESTS).
RES=$(mktemp -d)  # the device tool brings back at most 8 files: everything goes here, packed into one archive
trap 'tar czf "$OUT/gpu_check.tgz" -C "$RES" .' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$RES/gpu.txt"
source "$(dirname "$0")/gpu_env.sh" > "$RES/build.log" 2>&1  # builds build/lib, sets ORT_TRITON_LIBRARY
cat "$RES/build.log"
[ -f "$ORT_TRITON_LIBRARY" ] || exit 1
python3 -m ort_triton doctor 2>&1 | tee "$RES/doctor.txt"
python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short ${PYTEST_PATHS:-tests/gpu tests/ops} ${PYTEST_ARGS:-} \
  > "$RES/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$RES/gpu_tests.log" | tail -15
grep -m1 -B2 -A30 "^_____" "$RES/gpu_tests.log"   # the first failure, whole
# SANITIZE=1: compute-sanitizer memcheck and racecheck over the ORT-level GPU tests (`sanitize` in gpu_env.sh)
[ "${SANITIZE:-0}" = 1 ] && sanitize "$RES"
if [ "${SWEEPS:-0}" = 1 ]; then
  python3 -m ort_triton.bench.layer_norm_sweep --rows 65536,4096 --hidden ${SWEEP_HIDDEN:-4096,8192} \
    --modes residual,residual+sum --json "$RES/layer_norm_sweep.json" 2>&1 | tee "$RES/layer_norm_sweep.txt"
  for shape in 8x512 8x2048; do
    python3 -m ort_triton.bench.attention_sweep --shape $shape --head-dims ${SWEEP_HEAD_DIMS:-64} \
      --json "$RES/attention_sweep_$shape.json" 2>&1 | grep -v skipped | tee "$RES/attention_sweep_$shape.txt"
  done
fi
[ "${BENCH:-1}" = 1 ] || exit 0
[ "${ATTENTION_BENCH:-1}" = 1 ] &&
  python3 -m ort_triton.bench.attention --json "$RES/attention_bench.json" 2>&1 | tee "$RES/attention_bench.txt"
ln_libraries || exit 1  # LN_CANDIDATES: one more library per candidate launch table (scripts/gpu_env.sh)
timeout "${BENCH_TIMEOUT:-1200}" python3 -m ort_triton.bench.layer_norm "${LN_LIBS[@]}" --json "$RES/layer_norm_bench.json" \
  ${BENCH_ARGS:-} 2>&1 | grep -v CleanUnusedInitializers | tee "$RES/layer_norm_bench.txt"
