#!/usr/bin/env bash
# Session 9's issue-8 check (carry [".ortgpu", ".ortinc"]; start with `source .ortgpu/activate.sh &&`): BERT-base
# fp16 with CUDA graphs, the default library against the same library (A/A: the noise) and against the library
# tuned by TABLE (default: this session's table), in alternating rounds (ort_triton/bench/ab.py).
source "$(dirname "$0")/gpu_env.sh"
TABLE=${TABLE:-bench/results/session9/bert-base.tuning.json}
timeout 120 python3 -m ort_triton build --arch 90 --tuning "$TABLE" -o build/lib_tuned -q || exit 1
export ORT_TRITON_TUNED_LIBRARY=$PWD/build/lib_tuned/libort_triton.so
SHAPES=${SHAPES:-1x128,8x128,32x128,1x512,8x512,32x512,8x2048}
timeout 200 python3 -m ort_triton.bench.ab --hf-config bert-base --a ort_triton_cuda_graph --b ort_triton_cuda_graph \
  --shapes "$SHAPES" --json "$OUT/ab_bert-base_default_vs_default.json" 2>&1 | filter | tail -10
timeout 220 python3 -m ort_triton.bench.ab --hf-config bert-base --a ort_triton_cuda_graph --b ort_triton_tuned_cuda_graph \
  --shapes "$SHAPES" --json "$OUT/ab_bert-base_default_vs_tuned.json" 2>&1 | filter | tail -10
