#!/usr/bin/env bash
# Session 8's second GPU call (carry [".ortgpu", ".ortinc"]; start with `source .ortgpu/activate.sh &&`): a
# BERT tune with the screening round (ort_triton/tune.py), to see how many problems a 1-minute budget times;
# then where BERT-base 32x512's GPU time goes (CUPTI; PROFILE_RUNTIMES, default ours with CUDA graphs).
source "$(dirname "$0")/gpu_env.sh"
fused=build/tune_work/bert-base.fp16.opt.onnx
python3 scripts/fused_bert_fp16.py "$fused"
timeout 150 python3 -m ort_triton tune "$fused" --shapes 1x128,8x512,32x512,8x2048 --budget-min "${TUNE_MIN:-1}" \
  -o "$OUT/bert.tuning.json" 2>&1 | grep -v -E "Warning|warn\(" | tail -14
timeout 200 python3 -m ort_triton.bench.profile --hf-config bert-base --shapes 32x512 \
  --runtimes "${PROFILE_RUNTIMES:-ort_triton_cuda_graph}" --iters 10 --json "$OUT/profile_bert-base_32x512.json" 2>&1 \
  | grep -v -E "Warning|warn\(" | tail -30
