#!/usr/bin/env bash
# Session 9's BERT call (carry [".ortgpu", ".ortinc"]; start with `source .ortgpu/activate.sh &&`):
# where BERT-base's GPU time goes at the two shapes that miss issue 3's 1.2x (CUPTI, ours with CUDA graphs
# against ORT's optimizer, with the wall time so the GPU's idle share shows), then issue 8: a tune with the
# screening round at every bench shape, the tuned library, and tuned against default in one bench run.
# Each step is bounded so the call ends inside 10 minutes.
source "$(dirname "$0")/gpu_env.sh"
timeout 170 python3 -m ort_triton.bench.profile --hf-config bert-base --shapes "${PROFILE_SHAPES:-32x512,8x2048}" \
  --runtimes ort_triton_cuda_graph,ort_optimizer --iters 10 --json "$OUT/profile_bert-base.json" 2>&1 | filter | tail -40
SHAPES=${SHAPES:-1x128,8x128,32x128,1x512,8x512,32x512,8x2048}
fused=build/tune_work/bert-base.fp16.opt.onnx
python3 scripts/fused_bert_fp16.py "$fused"
timeout 150 python3 -m ort_triton tune "$fused" --shapes "$SHAPES" --budget-min "${TUNE_MIN:-1.2}" \
  -o "$OUT/bert-base.tuning.json" 2>&1 | filter | tail -24
[ -f "$OUT/bert-base.tuning.json" ] || exit 0  # the tune wrote no table: nothing to build or bench
timeout 90 python3 -m ort_triton build --arch 90 --tuning "$OUT/bert-base.tuning.json" -o build/lib_tuned -q || exit 1
export ORT_TRITON_TUNED_LIBRARY=$PWD/build/lib_tuned/libort_triton.so
timeout 150 python3 -m ort_triton bench --hf-config bert-base --dtype float16 --shapes "$SHAPES" \
  --runtimes ort_triton_cuda_graph,ort_triton_tuned_cuda_graph --warmup 10 --iters 100 \
  --out "$OUT/bench_bert-base_tuned" 2>&1 | filter | tail -30
