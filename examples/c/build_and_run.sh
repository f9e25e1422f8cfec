#!/usr/bin/env bash
# Build examples/c/run_model.c against the libonnxruntime of the installed onnxruntime(-gpu) wheel, run it on
# an optimized model, and compare its output with Python ORT's on the same inputs (PASSED/FAILED, exit 1 on
# a mismatch).
#
#   bash examples/c/build_and_run.sh cpu                  # fused ops through their function bodies
#   source .ortgpu/activate.sh && bash examples/c/build_and_run.sh cuda   # on the GPU machine, with the library
# Environment: MODEL (default: bert-tiny, exported and optimized here), BATCH, SEQ, ORT_TRITON_LIBRARY,
# ORT_INCLUDE_DIR (else the header ort-triton build fetched), PYTHON, OUT (a work directory).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${1:-cpu}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-$(mktemp -d)}
BATCH=${BATCH:-2} SEQ=${SEQ:-24}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
CAPI=$("$PY" -c "import onnxruntime, os; print(os.path.join(os.path.dirname(onnxruntime.__file__), 'capi'))")
LIBORT=$(ls "$CAPI"/libonnxruntime.so.* | head -1)
INC=${ORT_INCLUDE_DIR:-$("$PY" -c "
import pathlib
from ort_triton.aot.ort_header import find_ort_include
from ort_triton.paths import cache_dir
print(find_ort_include(None, cache_dir()))")}
# the wheel ships libonnxruntime.so.1.X.Y only; the binary asks for its soname, libonnxruntime.so.1. ORT loads
# its provider libraries (CUDA) from the directory it was loaded from: link them there too
mkdir -p "$OUT/lib" && ln -sf "$CAPI"/lib*.so* "$OUT/lib/"
ln -sf "$LIBORT" "$OUT/lib/libonnxruntime.so.1" && ln -sf "$LIBORT" "$OUT/lib/libonnxruntime.so"
gcc -std=c11 -O2 -Wall -Wextra -o "$OUT/run_model" examples/c/run_model.c -I"$INC" -L"$OUT/lib" -lonnxruntime \
  -Wl,-rpath,"$OUT/lib"
MODEL=${MODEL:-}
if [ -z "$MODEL" ]; then
  MODEL=$OUT/bert-tiny.ot.onnx
  "$PY" -c "
import onnx, graph_rewrites
from ort_triton import models
src = models.export(models.build('bert-tiny'), '$OUT/bert-tiny.onnx')
onnx.save(graph_rewrites.optimize(str(src)), '$MODEL')"
fi
LIB=-
if [ "$DEVICE" = cuda ]; then
  LIB=${ORT_TRITON_LIBRARY:-$("$PY" -c "import ort_triton; print(ort_triton.get_library_path())")}
fi
"$OUT/run_model" "$MODEL" "$LIB" "$DEVICE" "$BATCH" "$SEQ" "$OUT/c_output.bin"
"$PY" - "$MODEL" "$LIB" "$DEVICE" "$BATCH" "$SEQ" "$OUT/c_output.bin" <<'PYEOF'
import sys
import numpy as np
import onnxruntime as ort
model, lib, device, b, s, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
so = ort.SessionOptions()
if lib != "-":
    so.register_custom_ops_library(lib)
sess = ort.InferenceSession(model, so, providers=["CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"])
feeds = {}
for i in sess.get_inputs():  # the same inputs as run_model.c
    bb, ss = np.meshgrid(np.arange(b), np.arange(s), indexing="ij")
    v = (bb * 131 + ss * 31 + 7) % 500
    if "mask" in i.name or "token_type" in i.name:
        v = np.where((b > 1) & (bb == b - 1) & (ss >= s // 2), 0, 1)
    if "token_type" in i.name:
        v = np.zeros_like(v)
    feeds[i.name] = v.astype(np.int64)
want = sess.run(None, feeds)[0].astype(np.float32)
got = np.fromfile(out, np.float32).reshape(want.shape)
err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
print(f"C vs Python ({device}): max rel err {err:.2e} over {want.size} values:", "PASSED" if err < 1e-5 else "FAILED")
sys.exit(0 if err < 1e-5 else 1)
PYEOF
