#!/usr/bin/env bash
# Session 30's GPU calls (carry [".ortgpu", ".ortinc"]; start with `source .ortgpu/activate.sh &&`). STEPS picks
# them (default "kv_tests kv_ab"), each bounded so a call ends inside 10 minutes:
#   kv_tests  the sequence-first cache (ops/kv_layout.py): the cache ops' and CausalAttention's kernels natively with
#             seq_major = 1 and a present bound over its past, tiny decoders relaid on ORT's CUDA EP against the
#             original and their greedy tokens, and the heads-first GPU tests of the kernels it touched (the rotary
#             cache ops through ORT, CausalAttention through ORT and in the rewritten decoders). Log: $OUT/kv_tests.log.
#   kv_ab     Llama-1B (MODELS) through ORT with CUDA graphs: ort_triton_cuda_graph (A, the cache heads first, copied
#             every step) against ort_triton_seq_cuda_graph (B, sequence first, each present bound over its past),
#             alternating rounds, prefill PREFILL (1x512) and decode DECODE (1x1024,16x1024,1x4096,16x4096): what the
#             copy costs. JSON in $OUT/ab_kv_seq_MODEL.json.
#   kv_lib_ab the default (heads-first) path before these kernel changes (A: OLD_SRC's library, e.g. `mkdir -p
#             .old_src && git archive main ort_triton | tar -x -C .old_src`) against this tree's (B): no regression
#             at decode 1x1024 and 16x1024 (gpu_decoders.sh's lib_ab). JSON in $OUT/ab_kv_lib_llama-1b.json.
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-kv_tests kv_ab}; do
  echo "== $step"
  case $step in
  kv_tests)
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short \
      tests/ops/test_kv_seq_major_kernel.py tests/gpu/test_kv_seq_major_gpu.py tests/ops/test_qkv_rotary_cache_kernel.py \
      tests/ops/test_qkv_cache_kernel.py tests/gpu/test_causal_attention_gpu.py \
      -k "seq_major or cuda_ep_runs_the_kernel or generates or plan" > "$OUT/kv_tests.log" 2>&1
    echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kv_tests.log" | tail -12 ;;
  kv_ab)
    for model in ${MODELS:-llama-1b}; do
      timeout "${AB_TIMEOUT:-420}" python3 -m ort_triton.bench.ab --decoder "$model" --a ort_triton_cuda_graph \
        --b ort_triton_seq_cuda_graph --prefill "${PREFILL-1x512}" --decode "${DECODE-1x1024,16x1024,1x4096,16x4096}" \
        --rounds "${ROUNDS:-3}" --iters "${ITERS:-20}" --work build/decoder_work \
        --json "$OUT/ab_kv_seq_$model.json" 2>&1 | filter | tail -20
    done ;;
  kv_lib_ab)
    OLD_SRC=${OLD_SRC:-.old_src} AB_MODEL=llama-1b AB_PREFILL=${PREFILL-} AB_DECODE=${DECODE-1x1024,16x1024} \
      AB_TIMEOUT=${AB_TIMEOUT:-300} AB_JSON=ab_kv_lib_llama-1b STEPS=lib_ab bash "$(dirname "$0")/gpu_decoders.sh" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
