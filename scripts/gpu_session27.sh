#!/usr/bin/env bash
# Session 27's GPU calls (carry [".ortgpu", ".ortinc"]; start with `source .ortgpu/activate.sh &&`). STEPS picks
# them (default "tests ab"), each bounded so a call ends inside 10 minutes:
#   tests   AddRMSNorm(Linear|SwiGLU) after this session's kernel change (FUSED constexpr, narrower masked tiles: no
#           spills), natively and through ORT's CUDA EP, and the PDL chain that runs them (PYTEST_PATHS).
#   ab      Llama-1B, the default rules (A) against A + add_rms_norm_swiglu (B), prefill 1x512 and 8x512 (the steps
#           path: the norm a row a program, cuBLAS, the product) and decode 1x1024 and 16x1024 (the fused kernel):
#           the rule goes on by default if B >= A at every shape. JSON in $OUT/ab_swiglu_llama-1b.json.
#   gemma256  Gemma-2B's shape: CausalAttention at head dim 256 (new: the attention was ORT's before) against the
#           default rules without it (A = ort_triton_cuda_graph-causal_attention); its GPU tests first
#           (tests/gpu/test_causal_attention_gpu.py -k 256 or gemma). JSON in $OUT/ab_gemma-2b_attention256.json.
#   qwen3, gemma   scripts/gpu_session26.sh's A/B of qkv_norm_rotary_cache and gelu_mul.
#   profile_prefill  Llama-1B's prefill 1x512 kernel by kernel, the default against + add_rms_norm_swiglu (its steps
#           lose 3-5% at prefill: which one), and the GPU's idle time between kernels by the pair around each gap.
#           $OUT/profile_llama-1b_prefill.json.
#   micro   scripts/swiglu_steps_micro.py (session 28): each of AddRMSNormSwiGLU's prefill steps under the JIT against
#           the launch the unfused graph makes. $OUT/swiglu_steps_micro.jsonl.
#   profile Llama-1B's decode step 1x1024 kernel by kernel (CUPTI), A + add_rms_norm_swiglu against the same + linear
#           (session 26: Linear lost in the model, 0.99x, where the chain sweep had it at 1.01-1.19x): which of the
#           Q/K/V, o and down products loses. $OUT/profile_llama-1b_decode.json.
source "$(dirname "$0")/gpu_env.sh"
for step in ${STEPS:-tests ab}; do
  echo "== $step"
  case $step in
  tests)
    TEST_LOG=tests PYTEST_PATHS=${PYTEST_PATHS:-"tests/ops/test_norm_linear_op.py tests/gpu/test_pdl_chain.py"} \
      TEST_TIMEOUT=${TEST_TIMEOUT:-200} gpu_tests ;;
  ab)
    STEPS=ab B=ort_triton_cuda_graph+add_rms_norm_swiglu TAG=swiglu PREFILL=${PREFILL-1x512,8x512} \
      bash "$(dirname "$0")/gpu_session25.sh" ;;
  gemma256)
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -W ignore --tb=short \
      tests/gpu/test_causal_attention_gpu.py -k "256 or gemma or cuda_ep_runs" > "$OUT/tests_gemma256.log" 2>&1
    echo "pytest exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests_gemma256.log" | tail -12
    timeout "${AB_TIMEOUT:-300}" python3 -m ort_triton.bench.ab --decoder gemma-2b \
      --a ort_triton_cuda_graph-causal_attention --b ort_triton_cuda_graph --prefill "${PREFILL-1x512}" \
      --decode "${DECODE:-1x1024,16x1024}" --rounds "${ROUNDS:-3}" --iters "${ITERS:-20}" --work build/decoder_work \
      --json "$OUT/ab_gemma-2b_attention256.json" 2>&1 | filter | tail -12 ;;
  qwen3 | gemma) STEPS=$step bash "$(dirname "$0")/gpu_session26.sh" ;;
  profile)
    STEPS=profile PROFILE_RUNTIMES=ort_triton_cuda_graph+add_rms_norm_swiglu,ort_triton_cuda_graph+add_rms_norm_swiglu+linear \
      bash "$(dirname "$0")/gpu_session25.sh" ;;
  profile_prefill)  # which of AddRMSNormSwiGLU's steps loses at prefill (session 27: 0.953x at 1x512)
    timeout "${PROFILE_TIMEOUT:-240}" python3 -m ort_triton.bench.decoder --model llama-1b --prefill 1x512 --decode '' \
      --runtimes ort_triton_cuda_graph,ort_triton_cuda_graph+add_rms_norm_swiglu --iters 20 --work build/decoder_work \
      --profile --json "$OUT/profile_llama-1b_prefill.json" 2>&1 | filter | tail -4
    python3 - "$OUT/profile_llama-1b_prefill.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    p = r.get("gpu_profile")
    if p:
        print(r["runtime"], f"p50 {r['p50_ms']:.3f} ms, {p['total_us']:.0f} us GPU in {p['kernels_per_inference']:.0f} kernels")
        for t in p["top"][:12]:
            print(f"  {t['us']:8.1f}  {t['kernel'][:100]}")
        print(f"  idle between kernels {p.get('idle_us', 0):.0f} us, most:")
        for g in p.get("gaps", [])[:10]:
            print(f"  {g['us']:8.1f}  {g['between'][:120]}")
PY
    ;;
  micro)
    timeout "${MICRO_TIMEOUT:-150}" python3 scripts/swiglu_steps_micro.py --json "$OUT/swiglu_steps_micro.jsonl" 2>&1 |
      filter | tail -24 ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
