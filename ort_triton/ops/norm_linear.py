"""AddRMSNormLinear and AddRMSNormSwiGLU: a decoder layer's residual add and RMSNorm, fused into the projection that
reads the norm (Llama's packed Q/K/V), or into the gate and up projections with SwiGLU's product.

    sum = T(X + skip)                                    (the residual stream, returned when asked)
    n   = T(sum / sqrt(mean(sum^2) + epsilon) * gamma)   (AddRMSNorm, ops/rms_norm.py)
    AddRMSNormLinear:  Y = n @ WT^T                      WT [N, K], the weight stored transposed
    AddRMSNormSwiGLU:  Y = silu(n @ WGT^T) * (n @ WUT^T)  each product rounded to T first (SiluMul's inputs)

Why: a decode step at batch 1 runs per layer an AddRMSNorm launch, the Q/K/V GEMV, another AddRMSNorm, the gate
and up GEMVs and a SiluMul launch, each a few microseconds of launch and ramp for a few kilobytes of activations.
Here each group is one launch that streams its weights once (session 22's micro: 1.30x on a layer's projections).

Dispatch (ort_triton/native/norm_linear.c): up to the op's fused rows (CONFIGS: a decode step's) and a spec whose
key ranges fit K and N: one launch of the fused kernel (ort_triton/kernels/norm_linear.py, MODE 0). Otherwise the
same work in steps, each what the library ran before this op: the norm (MODE 1) into a workspace, cuBLAS on ORT's
handle for the GEMM(s) (the TN form, as Linear), and for SwiGLU the product (MODE 2).

Dispatch keys: FUSED (1: the planner asks for the fused kernel, 0: for the steps' spec, which takes any shape),
K_ALIGN (the largest power of two dividing K, at most 4096: a spec with BLOCK_K dividing K loads the weight
unmasked), K, N.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..contract import ANY, IO, Attr, Kernel, OpContract, Spec
from .linear import K_ALIGN_CAP  # the same key, computed by planner_util.c's ot_k_align
from .rms_norm import reference_add_rms_norm, rms_norm_body
from .swiglu import reference_silu_mul, silu_mul_body

KERNEL = Kernel(
    module="ort_triton.kernels.norm_linear",
    fn_name="norm_linear_fwd",
    signature={"X": "*{T}", "R": "*{T}", "G": "*{T}", "WT": "*{T}", "WT2": "*{T}", "Y": "*{T}", "S": "*{T}",
               "NB": "*{T}", "GB": "*{T}", "UB": "*{T}", "M": "i32", "N": "i32", "K": "i32", "eps": "fp32",
               "store_sum": "i32", "MODE": "i32"},
    native_plan="ot_norm_linear_plan",
    native_params="ot_norm_linear_params",
    dispatch_keys=("fused", "k_align", "k", "n"),
    pdl=True,
)

BLOCK_M = 16  # rows of the kernel's tiles (decode at batch <= 16); the MMA's smallest N

# Per op: (the most rows the fused kernel takes, k range, n range, BLOCK_N, BLOCK_K, num_stages, num_warps); first
# fit wins, each also gets a masked spec (any K) for the same ranges; past those rows, or outside the ranges, the
# steps run. From scripts/gemv_chain_sweep.py (session 24, H100; chains of distinct weights, so every weight comes
# from HBM as in a model), against the library's own launches (our AddRMSNorm, cuBLAS, our SiluMul):
# - AddRMSNormSwiGLU, Llama-1B's gate and up (2048 x 8192 each): 1.20x at one row (the one-row prologue), 1.09-1.10x
#   at 16 rows. BLOCK_N 32: 256 programs, about two per SM.
# - AddRMSNormLinear, Llama-1B's packed Q/K/V (2048 x 3072): 0.98x at one row, 0.74x at 16 (the norm's pass over K
#   before the weight streams costs what the saved launch saves): fused at one row only; the rule stays off.
CONFIGS = {
    False: ((1, (16, 8192), (1, ANY), 64, 256, 4, 4),),
    True: ((16, (16, 8192), (1, ANY), 32, 256, 3, 4),),
}
# The steps' specs (FUSED = 0): MODE 1 normalises a row a program in ROW_BLOCK chunks, MODE 2 multiplies flat blocks
# of BLOCK_M * BLOCK_N elements; any K and N (masked). Two: K % 16 == 0 declared (16-byte loads of each row, which
# starts at pid * K; kernels/norm_linear.py says why it matters), then any K.
STEPS_BLOCK_N, STEPS_BLOCK_K = 64, 128
STEPS_K_ALIGN = 16
ROW_BLOCK = 2048  # the chunk of one row (kernels/norm_linear.py _rstd_one_row): the one-row prologue, MODE 1
# BLOCK_K of the other tiles, each the widest whose spec compiles without spilling (ptxas, sm_80 and sm_90; tested in
# tests/aot/test_register_budget.py): fp32 tiles are twice the bytes, and a masked tile (BLOCK_K does not divide K,
# K not known to be a multiple of 16) needs more registers for its addresses and masks than an unmasked one.
MASKED_BLOCK_K = 128
FP32_BLOCK_K, FP32_MASKED_BLOCK_K = 32, 16
PRE_HOPPER_STAGES = 2  # sm_80-89: 100-164 KB of shared memory, not Hopper's 228 (a stage is 48 KB at BLOCK_K 256)


def _block_k(type_name: str, block_k: int, even: bool) -> int:
    if type_name == "float":
        return min(block_k, FP32_BLOCK_K if even else FP32_MASKED_BLOCK_K)
    return block_k if even else min(block_k, MASKED_BLOCK_K)


def _specs(swiglu: bool, type_name: str) -> list[Spec]:
    def spec(fused, max_rows, k_range, n_range, block_n, block_k, stages, warps, even, k_align=None):
        block_k = _block_k(type_name, block_k, even)
        if k_align is None:
            k_align = block_k if even else 1  # unmasked: BLOCK_K divides K
        return Spec(constexprs={"FUSED": fused, "SWIGLU": int(swiglu), "EVEN_K": int(even), "BLOCK_M": BLOCK_M,
                                "BLOCK_N": block_n, "BLOCK_K": block_k, "ROW_BLOCK": ROW_BLOCK},
                    num_warps=warps, num_stages=stages, pre_hopper=(warps, min(stages, PRE_HOPPER_STAGES)),
                    keys=((fused, fused), (k_align, K_ALIGN_CAP), k_range, n_range),
                    consts=(max_rows, block_n, block_k),
                    divisible_by_16=("X", "R", "G", "WT", "WT2", "Y", "S", "NB", "GB", "UB")
                    + (("K",) if even or k_align >= 16 else ()))

    configs = CONFIGS[swiglu]
    specs = [spec(1, *c, True) for c in configs] + [spec(1, *c, False) for c in configs]
    steps = (0, BLOCK_M, (1, ANY), (1, ANY), STEPS_BLOCK_N, STEPS_BLOCK_K, 1, 4, False)
    specs += [spec(*steps, k_align=STEPS_K_ALIGN), spec(*steps, k_align=1)]
    return specs


# ---- references (float64 numpy) ---------------------------------------------------------------------
def reference_add_rms_norm_linear(x, skip, gamma, wt, epsilon=1e-6):
    n, s = reference_add_rms_norm(x, skip, gamma, epsilon)
    return n @ np.asarray(wt, np.float64).T, s


def reference_add_rms_norm_swiglu(x, skip, gamma, wgt, wut, epsilon=1e-6):
    n, s = reference_add_rms_norm(x, skip, gamma, epsilon)
    return reference_silu_mul(n @ np.asarray(wgt, np.float64).T, n @ np.asarray(wut, np.float64).T)[0], s


# ---- function bodies -------------------------------------------------------------------------------
def _norm(opset: int) -> list[onnx.NodeProto]:
    return [helper.make_node("Add", ["X", "skip"], ["sum"]), *rms_norm_body("sum", opset, out="normed_sum")]


def _linear_body(opset: int) -> list[onnx.NodeProto]:
    # MatMul by the transposed weight: ORT folds the Transpose of a constant when it inlines the body
    n = helper.make_node
    return [*_norm(opset), n("Transpose", ["WT"], ["W"], perm=[1, 0]), n("MatMul", ["normed_sum", "W"], ["Y"])]


def _swiglu_body(opset: int) -> list[onnx.NodeProto]:
    n = helper.make_node
    return [*_norm(opset),
            n("Transpose", ["WGT"], ["WG"], perm=[1, 0]), n("MatMul", ["normed_sum", "WG"], ["gate"]),
            n("Transpose", ["WUT"], ["WU"], perm=[1, 0]), n("MatMul", ["normed_sum", "WU"], ["up"]),
            *silu_mul_body("gate", "up", "Y")]


_EPS = Attr("epsilon", "float", 1e-6, "added to the mean square before the square root")
_TYPES = ("float", "float16", "bfloat16")
_SUM = IO("sum", "X + skip, the residual stream that goes on", optional=True)

ADD_RMS_NORM_LINEAR = OpContract(
    name="AddRMSNormLinear",
    doc="sum = X + skip; Y = RMSNorm(sum, gamma) @ WT^T (WT [N, K], the weight transposed)",
    inputs=(IO("X", "[..., K]"), IO("skip", "same shape as X"), IO("gamma", "[K]"),
            IO("WT", "[N, K], the weight transposed")),
    outputs=(IO("Y", "[..., N]"), _SUM),
    attrs=(_EPS,),
    types=_TYPES,
    body=_linear_body,
    reference=reference_add_rms_norm_linear,
    kernel=KERNEL,
    specializations=lambda t: _specs(False, t),
)

ADD_RMS_NORM_SWIGLU = OpContract(
    name="AddRMSNormSwiGLU",
    doc="sum = X + skip; n = RMSNorm(sum, gamma); Y = silu(n @ WGT^T) * (n @ WUT^T) (WGT, WUT [I, K])",
    inputs=(IO("X", "[..., K]"), IO("skip", "same shape as X"), IO("gamma", "[K]"),
            IO("WGT", "[I, K], the gate weight transposed"), IO("WUT", "[I, K], the up weight transposed")),
    outputs=(IO("Y", "[..., I]"), _SUM),
    attrs=(_EPS,),
    types=_TYPES,
    body=_swiglu_body,
    reference=reference_add_rms_norm_swiglu,
    kernel=KERNEL,
    specializations=lambda t: _specs(True, t),
)
