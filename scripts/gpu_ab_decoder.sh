#!/usr/bin/env bash
# Issue 8 for Llama-1B (MODEL: another of bench.decoder's; carry [".ortgpu", ".ortinc"]; start with
# `source .ortgpu/activate.sh &&`): tune the fused model's kernels with a short budget, build the tuned library,
# then time the default library against itself (A/A: the noise) and against the tuned one (A/B), both with CUDA graphs, prefill and decode, in alternating
# rounds (ort_triton/bench/ab.py --decoder).
# One device call: every step runs under `timeout`, capped so the whole script ends DEADLINE s (default 570)
# after it started; the ab runs write their JSON after every shape, so a cut-short step keeps what it measured.
# The export and fused model (build/decoder_work, with one specialised model per shape), the table and the tuned
# library (build/ab_decoder) stay while the machine is warm: a second call skips them and has its time for the
# two ab runs (a cold machine spends ~3 min exporting and fusing; RETUNE=1 tunes again).
# Environment: AA (0: no A/A run), BUDGET_MIN (tuning budget, default 1), PREFILL / DECODE (default 1x512,8x512 / 1x1024,16x1024),
# ROUNDS / ITERS (default 10 / 20), A / B (default ort_triton_cuda_graph / ort_triton_tuned_cuda_graph), TABLE (a
# table to build from instead of tuning). Results in $OUT: llama-1b.tuning.json, tune_llama-1b.txt,
# ab_llama-1b_default_vs_default.json, ab_llama-1b_default_vs_tuned.json (and their .txt).
source "$(dirname "$0")/gpu_env.sh"
DEADLINE=${DEADLINE:-570}
MODEL=${MODEL:-llama-1b}  # or gpt2-small (the table must cover its buckets)
WORK=build/decoder_work
PREFILL=${PREFILL-1x512,8x512}  # empty: none
DECODE=${DECODE:-1x1024,16x1024}
BUDGET_MIN=${BUDGET_MIN:-1}
A=${A:-ort_triton_cuda_graph}
B=${B:-ort_triton_tuned_cuda_graph}
# cap SECONDS: the step's timeout, at most what is left before the deadline (fails when under 20 s are left)
cap() {
  local t=$1 left=$((DEADLINE - SECONDS))
  ((left < t)) && t=$left
  ((t >= 20)) || { echo "out of time (${SECONDS}s of ${DEADLINE}s) before: $2" >&2; return 1; }
  echo "$t"
}
mkdir -p build/ab_decoder "$WORK"
echo "library built (${SECONDS}s)"

# the bench's name for the fused model: keyed by the rules and graph_rewrites' source (bench.decoder OrtTriton.key)
fused=$WORK/$MODEL.float16.$(python3 -c 'from ort_triton.bench.decoder import OrtTriton; print(OrtTriton().key())').onnx
if [ ! -f "$fused.done" ]; then  # bench.decoder makes (and keeps) the export and the fused model
  t=$(cap 240 "export and fuse") || exit 1
  timeout "$t" python3 -m ort_triton.bench.decoder --model $MODEL --runtimes ort_triton --prefill 1x16 --decode '' \
    --work "$WORK" --json "$OUT/warmup.json" 2>&1 | filter | tail -3
  [ -f "$fused.done" ] || { echo "no fused model (${SECONDS}s)"; exit 1; }
fi
echo "fused model ready (${SECONDS}s)"

TABLE=${TABLE:-build/ab_decoder/$MODEL.tuning.json}
if [ "${RETUNE:-0}" = 1 ] || [ ! -f "$TABLE" ]; then
  rm -f "$TABLE" build/ab_decoder/lib_tuned/libort_triton.so
  t=$(cap $((BUDGET_MIN * 60 + 90)) "tune") || exit 1
  timeout "$t" python3 -m ort_triton tune "$fused" --shapes "$PREFILL" --decode "$DECODE" --budget-min "$BUDGET_MIN" \
    -o "$TABLE" 2>&1 | filter | tee "$OUT/tune_$MODEL.txt" | tail -15
  [ -f "$TABLE" ] || { echo "no table (${SECONDS}s)"; exit 1; }
fi
cp -f "$TABLE" "$OUT/$MODEL.tuning.json" 2>/dev/null
lib=build/ab_decoder/lib_tuned/libort_triton.so
if [ ! "$lib" -nt "$TABLE" ]; then
  t=$(cap 120 "build --tuning") || exit 1
  timeout "$t" python3 -m ort_triton build --arch 90 --tuning "$TABLE" -o build/ab_decoder/lib_tuned -q || exit 1
fi
export ORT_TRITON_TUNED_LIBRARY=$PWD/$lib
echo "tuned library ready (${SECONDS}s)"

AB=(--decoder $MODEL --prefill "$PREFILL" --decode "$DECODE" --rounds "${ROUNDS:-10}" --iters "${ITERS:-20}" --work "$WORK")
# A/A first (AA=0 skips it, for a cold machine's call: the noise was 0.99-1.01x in session 12): its run also makes
# the specialised models the A/B run reuses; the A/B run gets what is left
if [ "${AA:-1}" = 1 ]; then
  t=$(cap 200 "A/A") || exit 1
  timeout "$t" python3 -m ort_triton.bench.ab "${AB[@]}" --a "$A" --b "$A" \
    --json "$OUT/ab_${MODEL}_default_vs_default.json" 2>&1 | filter | tee "$OUT/ab_${MODEL}_default_vs_default.txt" | tail -8
fi
t=$(cap 600 "A/B") || exit 1
timeout "$t" python3 -m ort_triton.bench.ab "${AB[@]}" --a "$A" --b "$B" \
  --json "$OUT/ab_${MODEL}_default_vs_tuned.json" 2>&1 | filter | tee "$OUT/ab_${MODEL}_default_vs_tuned.txt" | tail -8
echo "done (${SECONDS}s)"
