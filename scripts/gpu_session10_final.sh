#!/usr/bin/env bash
# Session 10's last call (carry [".ortgpu", ".ortinc"], start with `source .ortgpu/activate.sh &&`), each step
# bounded so the call ends inside 10 minutes:
# 1. the LayerNorm kernel and ORT tests on the final launch table;
# 2. issue 4: one `ort-triton bench` run on BERT-base (every runtime, TensorRT reported missing), its table,
#    JSON, CSV and plot in $OUT/bench/;
# 3. issue 2: the LayerNorm table at the issue's shapes, the default library only, sessions per variant
#    as INSTANCES says.
source "$(dirname "$0")/gpu_env.sh"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short tests/ops/test_layer_norm_kernel.py \
  tests/gpu/test_layer_norm_ort.py tests/native/test_native.py > "$OUT/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -8
timeout "${BENCH_TIMEOUT:-270}" python3 -m ort_triton bench --hf-config bert-base --dtype float16 \
  --shapes "${SHAPES:-1x128,8x128,8x512}" --warmup 10 --iters 100 --out "$OUT/bench" \
  --runtimes ort_stock,ort_stock_cuda_graph,ort_optimizer,onnxscript_fusions,ort_triton,ort_triton_cuda_graph,torch_eager,torch_compile_cuda_graph,tensorrt \
  2>&1 | filter | tail -40
timeout "${LN_TIMEOUT:-150}" python3 -m ort_triton.bench.layer_norm --library "$ORT_TRITON_LIBRARY" \
  --instances "${INSTANCES:-2}" --json "$OUT/layer_norm.json" 2>&1 | grep -v CleanUnusedInitializers | tail -28 |
  tee "$OUT/layer_norm.txt"
