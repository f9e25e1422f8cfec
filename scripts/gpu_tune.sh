#!/usr/bin/env bash
# Issue 8 on the GPU: tune a model's fused kernels, build the tuned library, and time it against the default
# library in one run (the bench's ort_triton and ort_triton_tuned rows share the process, the inputs and the
# fused model). Results: $OUT/<model>.tuning.json (the table) and the bench JSON.
#   device run, carry [".ortgpu", ".ortinc"]:
#     source .ortgpu/activate.sh && MODEL=bert-base bash scripts/gpu_tune.sh
#     source .ortgpu/activate.sh && MODEL=llama-1b bash scripts/gpu_tune.sh      (reuses build/decoder_work)
# Environment: MODEL (bert-base | llama-1b), BUDGET_MIN (tuning budget, default 4), SHAPES / PREFILL / DECODE
# (the benchmark shapes, defaults those of gpu_bench_bert.sh and gpu_bench_decoder.sh), RUNTIMES (the bench's;
# default ort_triton and ort_triton_tuned with and without CUDA graphs for BERT, without for the decoder,
# whose graph runs need one static-shape export per shape), TWICE=1 (tune a second time and say whether the
# two tables agree bucket by bucket within the tuner's noise margin: issue 8's "same answer twice").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ort_triton_out}
MODEL=${MODEL:-bert-base}
BUDGET_MIN=${BUDGET_MIN:-4}
mkdir -p "$OUT" build
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ORT_TRITON_CACHE=/tmp/ort_triton_cache ORT_INCLUDE_DIR=${ORT_INCLUDE_DIR:-$PWD/.ortinc}
python3 -m ort_triton build --arch 90 -o build/lib -q || exit 1
export ORT_TRITON_LIBRARY=$PWD/build/lib/libort_triton.so
filter() { grep --line-buffered -v -E "Warning|warn\(|torchvision|^\s+(return|rename_mapping)"; }
# TWICE=1: the same tune again into a second table, then the agreement of the two
again() {
  [ "${TWICE:-0}" = 1 ] || return 0
  python3 -m ort_triton tune "$@" -o "$OUT/$MODEL.tuning.2.json" 2>&1 | filter | tail -2
  python3 -c "import sys; from ort_triton import tuning, tune
rows, summary = tuning.agreement(sys.argv[1], sys.argv[2], tune.NOISE)
[print(r) for r in rows if not r['agree']]; print('tuned twice:', summary)" "$OUT/$MODEL.tuning.json" "$OUT/$MODEL.tuning.2.json" \
    | tee "$OUT/tune_twice_$MODEL.txt"
}

case "$MODEL" in
  bert-base)
    SHAPES=${SHAPES:-1x128,8x128,32x128,1x512,8x512,32x512,8x2048}
    fused=build/tune_work/bert-base.fp16.opt.onnx
    python3 scripts/fused_bert_fp16.py "$fused" || exit 1  # the bench's export, fused (once)
    python3 -m ort_triton tune "$fused" --shapes "$SHAPES" --budget-min "$BUDGET_MIN" -o "$OUT/bert-base.tuning.json" \
      2>&1 | filter | tee "$OUT/tune_bert-base.txt"
    again "$fused" --shapes "$SHAPES" --budget-min "$BUDGET_MIN"
    python3 -m ort_triton build --arch 90 --tuning "$OUT/bert-base.tuning.json" -o build/lib_tuned -q || exit 1
    export ORT_TRITON_TUNED_LIBRARY=$PWD/build/lib_tuned/libort_triton.so
    python3 -m ort_triton bench --hf-config bert-base --dtype float16 --shapes "$SHAPES" \
      --runtimes "${RUNTIMES:-ort_triton,ort_triton_tuned,ort_triton_cuda_graph,ort_triton_tuned_cuda_graph}" \
      --warmup 10 --iters 100 --out "$OUT/bench_bert-base" 2>&1 | filter | tail -40 ;;
  llama-1b)
    PREFILL=${PREFILL:-1x512,8x512,1x2048,8x2048}
    DECODE=${DECODE:-1x1024,16x1024,1x4096,16x4096}
    # the bench's name for the fused model: keyed by the rules and graph_rewrites' source (bench.decoder OrtTriton.key)
    fused=build/decoder_work/llama-1b.float16.$(python3 -c 'from ort_triton.bench.decoder import OrtTriton; print(OrtTriton().key())').onnx
    if [ ! -f "$fused.done" ]; then  # the bench makes (and keeps) the fused model
      python3 -m ort_triton.bench.decoder --model llama-1b --runtimes ort_triton --prefill 1x16 --decode '' \
        --work build/decoder_work --json "$OUT/warmup.json" 2>&1 | filter | tail -3
    fi
    python3 -m ort_triton tune "$fused" --shapes "$PREFILL" --decode "$DECODE" --budget-min "$BUDGET_MIN" \
      -o "$OUT/llama-1b.tuning.json" 2>&1 | filter | tee "$OUT/tune_llama-1b.txt"
    again "$fused" --shapes "$PREFILL" --decode "$DECODE" --budget-min "$BUDGET_MIN"
    python3 -m ort_triton build --arch 90 --tuning "$OUT/llama-1b.tuning.json" -o build/lib_tuned -q || exit 1
    export ORT_TRITON_TUNED_LIBRARY=$PWD/build/lib_tuned/libort_triton.so
    python3 -m ort_triton.bench.decoder --model llama-1b --prefill "$PREFILL" --decode "$DECODE" \
      --runtimes "${RUNTIMES:-ort_triton,ort_triton_tuned}" \
      --work build/decoder_work --json "$OUT/bench_llama-1b.json" 2>&1 | filter | tee "$OUT/bench_llama-1b.txt" ;;
  *) echo "MODEL must be bert-base or llama-1b" >&2; exit 2 ;;
esac
