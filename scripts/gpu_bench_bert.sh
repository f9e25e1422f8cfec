#!/usr/bin/env bash
# BERT-base fp16 against every runtime, for issues 3 and 4. torch.compile takes 7-77 s a shape on the H200
# (FACTS.md), so one device call (10 min) holds one phase; the phases write separate JSON files that
#   python -m ort_triton.bench.report A.json B.json C.json --out bench/results/bert-base-fp16-h200
# merges here. Usage, one device call each, carry [".ortgpu", ".ortinc"]:
#   source .ortgpu/activate.sh && bash scripts/gpu_bench_bert.sh ort            # ORT runtimes, ours, eager (~3 min)
#   source .ortgpu/activate.sh && bash scripts/gpu_bench_bert.sh opset23        # the opset-23 export (ONNX Attention)
#   source .ortgpu/activate.sh && bash scripts/gpu_bench_bert.sh pack           # packed Q/K/V against three GEMMs
#   source .ortgpu/activate.sh && bash scripts/gpu_bench_bert.sh compile_cg     # torch.compile reduce-overhead (~2 min)
#   source .ortgpu/activate.sh && bash scripts/gpu_bench_bert.sh compile        # torch.compile
#   source .ortgpu/activate.sh && bash scripts/gpu_bench_bert.sh tensorrt       # one engine build per shape: slow
# A warm machine is released 30 s after a call: issue the next call at once, then give it back.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ort_triton_out}
SHAPES=${SHAPES:-1x128,8x128,32x128,1x512,8x512,32x512,8x2048}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ORT_TRITON_CACHE=/tmp/ort_triton_cache ORT_INCLUDE_DIR=${ORT_INCLUDE_DIR:-$PWD/.ortinc}
case "${1:?phase: ort | opset23 | pack | compile_cg | compile | tensorrt}" in
  ort|opset23|pack)
    python3 -m ort_triton build --arch 90 -o build/lib | tail -1
    export ORT_TRITON_LIBRARY=$PWD/build/lib/libort_triton.so
    runtimes=ort_stock,ort_stock_cuda_graph,ort_optimizer,ort_optimizer_same_export,onnxscript_fusions,ort_triton,ort_triton_cuda_graph,torch_eager
    if [ "$1" = opset23 ]; then runtimes=ort_stock,ort_stock_cuda_graph,ort_triton,ort_triton_cuda_graph; EXTRA="--opset 23"; fi
    if [ "$1" = pack ]; then
      runtimes=ort_optimizer,ort_stock_cuda_graph,ort_triton,ort_triton_cuda_graph,ort_triton_unpacked,ort_triton_unpacked_cuda_graph
    fi ;;
  compile) runtimes=torch_compile ;;
  compile_cg) runtimes=torch_compile_cuda_graph ;;
  tensorrt) runtimes=tensorrt ;;
  *) echo "unknown phase $1" >&2; exit 2 ;;
esac
python3 -m ort_triton bench --hf-config bert-base --dtype float16 --shapes "$SHAPES" --runtimes "$runtimes" ${EXTRA:-} \
  --warmup 10 --iters 100 --out "$OUT/$1" 2>&1 | grep -v Warning | tail -80
