#!/usr/bin/env bash
# Session 7's GPU check in one device call (carry [".ortgpu", ".ortinc"]; start with
# `source .ortgpu/activate.sh &&`): the library for sm_90, the packed-attention GPU tests, packed against
# unpacked attention kernels, BERT-base packed/unpacked beside ORT's best, and a BERT tune with the
# candidates compiled ahead. Each step is bounded so the call ends inside 10 minutes.
source "$(dirname "$0")/gpu_env.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu/test_attention_ort.py tests/gpu/test_bert_cuda.py \
  tests/ops/test_attention_kernel.py -k "packed or bert" 2>&1 | tail -2
timeout 60 python3 scripts/packed_attention_micro.py 2>&1 | grep -v Warn | tee "$OUT/packed_attention_micro.jsonl"
SHAPES=${SHAPES:-1x128,8x128,32x128,1x512,8x512,32x512,8x2048} timeout 240 bash scripts/gpu_bench_bert.sh pack 2>&1 | tail -52
[ "${TUNE:-1}" = 1 ] || exit 0
fused=build/tune_work/bert-base.fp16.opt.onnx
python3 scripts/fused_bert_fp16.py "$fused"
timeout 150 python3 -m ort_triton tune "$fused" --shapes 1x128,8x512,8x2048 --budget-min "${TUNE_MIN:-1.5}" \
  -o "$OUT/bert.tuning.json" 2>&1 | grep -v -E "Warning|warn\(" | tail -8
