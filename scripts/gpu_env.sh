# Sourced by the session GPU scripts (scripts/gpu_session*.sh): the repo root, $OUT, the environment the
# device's Python needs (PYTHONPATH appended to, never replaced: .ortgpu/activate.sh puts onnxruntime-gpu
# on it), the library built for sm_90 into build/lib and exported as ORT_TRITON_LIBRARY, `filter`, which
# drops the exporters' and ORT's warning lines from a step's output, and `ln_libraries`, which builds one
# more library per LayerNorm candidate launch table.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/ort_triton_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ORT_TRITON_CACHE=/tmp/ort_triton_cache ORT_INCLUDE_DIR=${ORT_INCLUDE_DIR:-$PWD/.ortinc}
python3 -m ort_triton build --arch 90 -o build/lib 2>&1 | tail -1
export ORT_TRITON_LIBRARY=$PWD/build/lib/libort_triton.so
filter() { grep --line-buffered -v -E "Warning|warn\(|torchvision|^\s+(return|rename_mapping)|broadcast between"; }

# LN_CANDIDATES="a={json};b={json}": one more library per candidate launch table (ops/layer_norm.py,
# ORT_TRITON_LAYER_NORM_LAUNCH), built into build/ln_NAME; sets LN_LIBS to the `--library` arguments of
# bench.layer_norm (the default library first, then NAME=PATH for each candidate).
ln_libraries() {
  LN_LIBS=(--library "$ORT_TRITON_LIBRARY")
  local cands cand name
  IFS=';' read -ra cands <<< "${LN_CANDIDATES:-}"
  for cand in "${cands[@]}"; do
    name=${cand%%=*}
    ORT_TRITON_LAYER_NORM_LAUNCH=${cand#*=} python3 -m ort_triton build --arch 90 -o "build/ln_$name" -q || return 1
    LN_LIBS+=(--library "$name=$PWD/build/ln_$name/libort_triton.so")
  done
}
