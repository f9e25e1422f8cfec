"""Linear: a MatMul by a constant weight, the weight stored transposed.

    Y[..., N] = X[..., K] @ W,   W = WT^T,   WT [N, K] (K contiguous)

Why: a decode step at batch 1 multiplies one row by every weight of the model, and cuBLAS's GEMV reads them at
46-70% of the GPU's bandwidth at Llama-1B's shapes (scripts/decode_linear_micro.py, scripts/gemv_sweep.py).
Held transposed, a weight's rows are what one output column needs, contiguous, so a GEMV program streams whole
rows with no partial sums to combine (ort_triton/kernels/gemv.py). The rewrite (graph_rewrites/linear.py)
stores the constant so; a tied LM head (MatMul(x, Transpose(E))) already is.

Dispatch (ort_triton/native/linear.c): one row of X (the product of its leading dims is 1) -> the Triton GEMV
with the spec the shape's keys pick; more rows, or a one-row shape no spec serves -> cuBLAS on ORT's handle for
the node's stream (the TN GEMM, fp32 accumulation), the GEMM ORT's MatMul runs.

Dispatch keys: K_ALIGN (the largest power of two dividing K, at most 4096: a spec whose BLOCK_K divides K loads
unmasked), K, N. Rounding: one, of the fp32 sum, to the element type (as cuBLAS).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..contract import IO, Kernel, OpContract, Spec

KERNEL = Kernel(
    module="ort_triton.kernels.gemv",
    fn_name="gemv_fwd",
    signature={"X": "*{T}", "WT": "*{T}", "Y": "*{T}", "N": "i32", "K": "i32"},
    native_plan="ot_linear_plan",
    native_params="ot_linear_params",
    dispatch_keys=("k_align", "k", "n"),
)

K_ALIGN_CAP = 4096  # planner_util.c's ot_k_align() stops here (ops/norm_linear.py's K_ALIGN key too)

# (k range, n range, BLOCK_N, BLOCK_K, num_warps): the GEMV configs, first fit wins; a one-row shape outside
# every range runs cuBLAS. Each gets an unmasked spec (K a multiple of BLOCK_K) and, for the same ranges, a
# masked one with BLOCK_K = MASKED_BLOCK_K.
# Session 23 on the H100 (bench/results/README.md): every one-row shape on the GEMV was 0.968x at Llama-1B's
# decode 1x1024; alone it beat cuBLAS at GPT-2 small's shapes (1.2-2.4x) and Llama's o-projection (1.16x), and
# lost where the weight is large (Llama's qkv, gate, up, down, lm_head: 0.60-0.90x). So the GEMV takes the
# small weights only, until a better kernel (the fused norm and SwiGLU of scripts/decode_linear_micro.py) wins.
CONFIGS = (
    ((1, 1024), (1, 4096), 2, 1024, 4),
    ((1, 4096), (1, 2048), 2, 1024, 4),
)
MASKED_BLOCK_K = 256


def _specs(_type_name: str) -> list[Spec]:
    specs = []
    for k_range, n_range, block_n, block_k, warps in CONFIGS:
        specs.append(Spec(constexprs={"BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_K": 1}, num_warps=warps,
                          keys=((block_k, K_ALIGN_CAP), k_range, n_range), consts=(block_n, block_k),
                          divisible_by_16=("X", "WT", "Y", "K")))
    for k_range, n_range, block_n, _, warps in CONFIGS:
        specs.append(Spec(constexprs={"BLOCK_N": block_n, "BLOCK_K": MASKED_BLOCK_K, "EVEN_K": 0}, num_warps=warps,
                          keys=((1, K_ALIGN_CAP), k_range, n_range), consts=(block_n, MASKED_BLOCK_K),
                          divisible_by_16=("X", "WT", "Y")))
    return specs


def reference_linear(x, wt):
    return (np.asarray(x, np.float64) @ np.asarray(wt, np.float64).T,)


def _body(_opset: int) -> list[onnx.NodeProto]:
    # MatMul by the transposed weight: ORT folds the Transpose of a constant when it inlines the body
    n = helper.make_node
    return [n("Transpose", ["WT"], ["W"], perm=[1, 0]), n("MatMul", ["X", "W"], ["Y"])]


LINEAR = OpContract(
    name="Linear",
    doc="Y = X @ WT^T: MatMul by a weight stored transposed (WT [N, K]); X [..., K], Y [..., N]",
    inputs=(IO("X", "[..., K]"), IO("WT", "[N, K], the weight transposed")),
    outputs=(IO("Y", "[..., N]"),),
    attrs=(),
    types=("float16", "bfloat16", "float"),
    body=_body,  # Transpose and MatMul: the same from opset 15 on
    reference=reference_linear,
    kernel=KERNEL,
    specializations=_specs,
)
