"""Linear: a MatMul by a constant weight, the weight stored transposed.

    Y[..., N] = X[..., K] @ W,   W = WT^T,   WT [N, K] (K contiguous)

Why: a decode step at batch 1 multiplies one row by every weight of the model, and cuBLAS's GEMV reads them at
46-70% of the GPU's bandwidth at Llama-1B's shapes (scripts/decode_linear_micro.py, scripts/gemv_sweep.py).
Held transposed, a weight's rows are what one output column needs, contiguous, so a GEMV program streams whole
rows with no partial sums to combine (ort_triton/kernels/gemv.py). The rewrite (graph_rewrites/linear.py)
stores the constant so; a tied LM head (MatMul(x, Transpose(E))) already is.

Dispatch (ort_triton/native/linear.c): up to 16 rows of X (the product of its leading dims: a decode step) -> the
Triton kernel with the spec the shape's keys pick, the register GEMV or the tl.dot "skinny" product
(ort_triton/kernels/gemv.py); more rows, or a shape no spec serves -> cuBLAS on ORT's handle for the node's stream
(the TN GEMM, fp32 accumulation), the GEMM ORT's MatMul runs.

Dispatch keys: ROWS, K_ALIGN (the largest power of two dividing K, at most 4096: a spec whose BLOCK_K divides K
loads unmasked), K, N. Rounding: one, of the fp32 sum, to the element type (as cuBLAS).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..contract import ANY, IO, Kernel, OpContract, Spec

KERNEL = Kernel(
    module="ort_triton.kernels.gemv",
    fn_name="gemv_fwd",
    signature={"X": "*{T}", "WT": "*{T}", "Y": "*{T}", "M": "i32", "N": "i32", "K": "i32"},
    native_plan="ot_linear_plan",
    native_params="ot_linear_params",
    dispatch_keys=("rows", "k_align", "k", "n"),
    pdl=True,
)

K_ALIGN_CAP = 4096  # planner_util.c's ot_k_align() stops here (ops/norm_linear.py's K_ALIGN key too)
BLOCK_M = 16  # the skinny product's rows (the MMA's smallest N): up to 16 rows run a kernel of ours

# (dot, most rows, k range, n range, BLOCK_N, BLOCK_K, num_stages), num_warps 4: first fit wins; a shape outside
# every range runs cuBLAS. Each gets an unmasked spec (K a multiple of BLOCK_K) and after it, for the same ranges, a
# masked one (the GEMV's BLOCK_K = MASKED_BLOCK_K). From scripts/gemv_chain_sweep.py (session 24, H200: chains of
# distinct weights, each read from HBM as in a model), against cuBLAS as ORT's MatMul runs it:
# - the register GEMV, one row, K long against N: Llama-1B's o 1.14x, down 1.11x, GPT-2's mlp.c_proj 1.95x; and
#   GPT-2's other projections (session 23, H100: 1.24-1.69x, 1.081x on its decode step);
# - the skinny product everywhere else up to 16 rows: Llama's packed Q/K/V 1.03x, gate or up 1.11x, lm_head 1.03x;
#   at 16 rows 1.01-1.19x (down 1.02x).
CONFIGS = (
    (False, 1, (1, 1024), (1, 4096), 2, 1024, 1),
    (False, 1, (1, 8192), (1, 2048), 2, 1024, 1),
    (True, BLOCK_M, (1, ANY), (1, 4096), 32, 256, 4),
    (True, BLOCK_M, (1, ANY), (4097, ANY), 64, 128, 4),
)
MASKED_BLOCK_K = 256  # the register GEMV's masked specs (the skinny ones keep theirs: a masked tile is a tile)
FP32_BLOCK_K = 64  # the skinny product's fp32 tiles: twice the bytes, and sm_80-89's shared memory
PRE_HOPPER_STAGES = 2  # sm_80-89: 100-164 KB of shared memory, not Hopper's 228


def _specs(type_name: str) -> list[Spec]:
    def spec(dot, rows, k_range, n_range, block_n, block_k, stages, even):
        if not even and not dot:
            block_k = MASKED_BLOCK_K
        if dot and type_name == "float":
            block_k = min(block_k, FP32_BLOCK_K)
        return Spec(constexprs={"BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_K": int(even), "DOT": int(dot),
                                "BLOCK_M": BLOCK_M},
                    num_warps=4, num_stages=stages, pre_hopper=(4, min(stages, PRE_HOPPER_STAGES)),
                    keys=((1, rows), (block_k if even else 1, K_ALIGN_CAP), k_range, n_range),
                    consts=(block_n, block_k), divisible_by_16=("X", "WT", "Y") + (("K",) if even else ()))

    # each config's unmasked spec, then its masked one: the first config that fits serves, masked or not
    return [spec(*c, even) for c in CONFIGS for even in (True, False)]


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
