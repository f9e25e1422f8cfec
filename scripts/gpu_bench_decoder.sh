#!/usr/bin/env bash
# Decoder prefill and decode latency on the GPU (issue 5): the library for sm_90, then
# ort_triton.bench.decoder per model. Results: $OUT/decoder_<model>.json and .txt.
#   device run, carry [".ortgpu", ".ortinc"]:  source .ortgpu/activate.sh && bash scripts/gpu_bench_decoder.sh
# Environment: MODELS (default "llama-1b gpt2-small"), RUNTIMES (comma-separated, default the bench's),
# PREFILL / DECODE (shapes), ARGS (more bench arguments), ORT_TRITON_LIBRARY (skip the build).
# The JSON is rewritten after every runtime, so a run cut short by the device's 10 minutes keeps what it
# measured: a 1B model takes ~3 min to export twice and fuse; give each runtime set its own call. The exports
# and fused models stay in build/decoder_work, which the device keeps between calls while the machine is
# warm: chain the calls and the later ones skip that work.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ort_triton_out}
mkdir -p "$OUT" build
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ORT_TRITON_CACHE=/tmp/ort_triton_cache ORT_INCLUDE_DIR=${ORT_INCLUDE_DIR:-$PWD/.ortinc}
if [ -z "${ORT_TRITON_LIBRARY:-}" ]; then
  python3 -m ort_triton build --arch 90 -o build/lib -q || exit 1
  export ORT_TRITON_LIBRARY=$PWD/build/lib/libort_triton.so
fi
for model in ${MODELS:-llama-1b gpt2-small}; do
  python3 -m ort_triton.bench.decoder --model "$model" ${RUNTIMES:+--runtimes "$RUNTIMES"} \
    ${PREFILL:+--prefill "$PREFILL"} ${DECODE:+--decode "$DECODE"} ${ARGS:-} --work build/decoder_work \
    --json "$OUT/decoder_$model.json" 2>&1 \
    | grep --line-buffered -v -E "Warning|warn\(|torchvision|^\s+(return|rename_mapping)" | tee "$OUT/decoder_$model.txt"
done
