#!/usr/bin/env bash
# Session 8's GPU check in one device call (carry [".ortgpu", ".ortinc"]; start with
# `source .ortgpu/activate.sh &&`): the library for sm_90; the kernel tests of BiasGelu (GELU through erfc)
# and the linear kernel on the GPU, the BERT CUDA tests; BiasGelu against its memory floor; BERT-base ours
# against ORT's best configurations at every shape. Each step is bounded so the call ends inside 10 minutes.
source "$(dirname "$0")/gpu_env.sh"
timeout 240 python3 -m pytest -q -p no:cacheprovider -W ignore tests/ops/test_bias_gelu_kernel.py \
  tests/ops/test_linear_kernel.py tests/gpu/test_bert_cuda.py 2>&1 | tail -2
timeout 60 python3 scripts/bias_gelu_micro.py 2>&1 | grep -v Warn | tee "$OUT/bias_gelu_micro.jsonl"
SHAPES=${SHAPES:-1x128,8x128,32x128,1x512,8x512,32x512,8x2048}
timeout 300 python3 -m ort_triton bench --hf-config bert-base --dtype float16 --shapes "$SHAPES" \
  --runtimes ort_optimizer,ort_stock_cuda_graph,ort_triton,ort_triton_cuda_graph --warmup 10 --iters 100 \
  --out "$OUT/bert" 2>&1 | grep -v Warning | tail -40
