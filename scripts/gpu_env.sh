# Sourced by the session GPU scripts (scripts/gpu_session*.sh): the repo root, $OUT, the environment the
# device's Python needs (PYTHONPATH appended to, never replaced: .ortgpu/activate.sh puts onnxruntime-gpu
# on it), the library built for sm_90 into build/lib and exported as ORT_TRITON_LIBRARY, `filter`, which
# drops the exporters' and ORT's warning lines from a step's output, and `ln_libraries`, which builds one
# more library per LayerNorm candidate launch table, and `sanitize`, compute-sanitizer over GPU tests.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/ort_triton_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ORT_TRITON_CACHE=/tmp/ort_triton_cache ORT_INCLUDE_DIR=${ORT_INCLUDE_DIR:-$PWD/.ortinc}
python3 -m ort_triton build --arch 90 -o build/lib 2>&1 | tail -1
export ORT_TRITON_LIBRARY=$PWD/build/lib/libort_triton.so
filter() { grep --line-buffered -v -E "Warning|warn\(|torchvision|^\s+(return|rename_mapping)|broadcast between"; }

# build_tree DIR OUT: the library of DIR's ort_triton package (another tree, e.g. `git archive REV ort_triton | tar -x
# -C DIR`) built for sm_90 into OUT (relative to the repo root). From inside DIR: `python -m` puts the working
# directory first on sys.path, ahead of PYTHONPATH (until session 29 LN_SOURCES built this tree's package so).
build_tree() {
  [ -f "$1/ort_triton/__init__.py" ] || { echo "build_tree: no $1/ort_triton" >&2; return 1; }
  local out=$PWD/$2
  (cd "$1" && python3 -m ort_triton build --arch 90 -o "$out" -q)
}

# LN_CANDIDATES="a={json};b={json}": one more library per candidate launch table (ops/layer_norm.py,
# ORT_TRITON_LAYER_NORM_LAUNCH), built into build/ln_NAME; LN_SOURCES="a=DIR;b=DIR": one more library per
# kernel variant, built from another copy of the package (DIR/ort_triton, e.g. `git archive REV ort_triton |
# tar -x -C DIR`, carried to the device) into build/ln_NAME. Sets LN_LIBS to the `--library` arguments of
# bench.layer_norm (the default library first, then NAME=PATH for each candidate and variant).
ln_libraries() {
  LN_LIBS=(--library "$ORT_TRITON_LIBRARY")
  local cands cand name
  IFS=';' read -ra cands <<< "${LN_CANDIDATES:-}"
  for cand in "${cands[@]}"; do
    name=${cand%%=*}
    ORT_TRITON_LAYER_NORM_LAUNCH=${cand#*=} python3 -m ort_triton build --arch 90 -o "build/ln_$name" -q || return 1
    LN_LIBS+=(--library "$name=$PWD/build/ln_$name/libort_triton.so")
  done
  IFS=';' read -ra cands <<< "${LN_SOURCES:-}"
  for cand in "${cands[@]}"; do
    name=${cand%%=*}
    build_tree "${cand#*=}" "build/ln_$name" || return 1
    LN_LIBS+=(--library "$name=$PWD/build/ln_$name/libort_triton.so")
  done
}

# ln_chains HIDDEN: ln_libraries, then bench.layer_norm over them at LN_ROWS (default 4096 and 65536) x LN_HIDDEN
# (default HIDDEN), LN_INSTANCES sessions a variant (default 3), each row count bounded by LN_TIMEOUT (150 s);
# JSON in $OUT/ln_variants_ROWS.json.
ln_chains() {
  ln_libraries || return 1
  local rows
  for rows in ${LN_ROWS:-4096 65536}; do
    timeout "${LN_TIMEOUT:-150}" python3 -m ort_triton.bench.layer_norm "${LN_LIBS[@]}" --instances "${LN_INSTANCES:-3}" \
      --rows "$rows" --hidden "${LN_HIDDEN:-$1}" --json "$OUT/ln_variants_$rows.json" 2>&1 |
      grep -v CleanUnusedInitializers | tail -40
  done
}

# gpu_tests: pytest on the GPU, by default the LayerNorm kernel natively on CUDA and the ORT-level LayerNorm GPU
# tests (PYTEST_PATHS: other paths and options, split on spaces; -k matches ignoring case), bounded by
# TEST_TIMEOUT (default 150 s); the log is $OUT/${TEST_LOG:-gpu_tests}.log.
gpu_tests() {
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short \
    ${PYTEST_PATHS:-tests/ops/test_layer_norm_kernel.py tests/gpu -k "layer_norm or LayerNorm"} > "$OUT/${TEST_LOG:-gpu_tests}.log" 2>&1
  echo "pytest exit $?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/${TEST_LOG:-gpu_tests}.log" | tail -12
}

# sanitize DIR: compute-sanitizer memcheck and racecheck over the ORT-level GPU tests (the AOT cubins through
# the native launcher, at the tests' shapes; SANITIZE_TESTS, default `tests/gpu -k ort`), checking only our
# kernels (--kernel-regex) so the rest runs at speed; each tool bounded by SANITIZE_TIMEOUT s (0, the default:
# none). Logs: DIR/sanitize_TOOL.log.
sanitize() {
  local dir=$1 tool kernels
  kernels=$(python3 -c "from ort_triton.ops import ALL_OPS; print('|'.join(sorted({o.kernel.fn_name for o in ALL_OPS})))")
  for tool in memcheck racecheck; do
    timeout "${SANITIZE_TIMEOUT:-0}" compute-sanitizer --tool $tool --kernel-regex kns="$kernels" --error-exitcode 97 \
      --print-limit 20 python3 -m pytest -q -x -p no:cacheprovider -W ignore ${SANITIZE_TESTS:-tests/gpu -k ort} \
      > "$dir/sanitize_$tool.log" 2>&1
    echo "compute-sanitizer $tool (kernels $kernels): exit $?; $(grep -h "SUMMARY" "$dir/sanitize_$tool.log" | tail -1)"
    grep -E "passed|failed" "$dir/sanitize_$tool.log" | tail -1
  done
}
