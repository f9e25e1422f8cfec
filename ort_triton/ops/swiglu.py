"""SiluMul: the epilogue of a SwiGLU MLP (Llama, Mistral, Qwen2), between its GEMMs.

    MLP(x) = down(silu(gate(x)) * up(x))
    Y      = silu(gate) * up = gate * sigmoid(gate) * up          gate, up [..., I], the same shape

The three GEMMs stay ORT's MatMul (cuBLAS), as for BiasGelu; fusing what sits between them turns three
elementwise passes over [rows, I] (Sigmoid, Mul, Mul: 7 tensor reads and writes) into one (gate and up
in, Y out). Whether to pack gate and up into one [H, 2I] MatMul is a later decision, to be measured on
the GPU; this op takes them as two tensors either way.

The kernel (ort_triton/kernels/swiglu.py) is elementwise and memory-bound: a 2-D grid of (ROWS x
BLOCK_I) tiles over [rows, I], math in fp32, sigmoid(g) = 1 / (1 + exp(-g)) (exp overflows to inf for
g << 0, giving g * 0 = -0: no NaN).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..contract import IO, Kernel, OpContract, Spec

BLOCK_I = 1024
ROWS = 4
NUM_WARPS = 4

KERNEL = Kernel(
    module="ort_triton.kernels.swiglu",
    fn_name="silu_mul_fwd",
    signature={"G": "*{T}", "U": "*{T}", "Y": "*{T}", "n_rows": "i32", "n_cols": "i32"},
    native_plan="ot_silu_mul_plan",
    native_params="ot_silu_mul_params",
    dispatch_keys=("i_div16",),
)


def _specs(_type_name: str) -> list[Spec]:
    # the launch shape of BiasGelu (the same traffic per element plus one input), to be swept on the GPU
    return [Spec(constexprs={"BLOCK_I": BLOCK_I, "ROWS": ROWS}, num_warps=NUM_WARPS, keys=((aligned, 1),),
                 consts=(ROWS, BLOCK_I), divisible_by_16=("G", "U", "Y") + (("n_cols",) if aligned else ()))
            for aligned in (1, 0)]  # aligned first: the planner takes the first spec that fits


def reference_silu_mul(gate, up):
    g, u = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    return (g / (1.0 + np.exp(-g)) * u,)


def silu_mul_body(gate: str = "gate", up: str = "up", out: str = "Y") -> list[onnx.NodeProto]:
    """out = silu(gate) * up, in the exporters' own spelling and order: a fused model computes what the original
    did, bit for bit. Also the epilogue of AddRMSNormSwiGLU's body (ops/norm_linear.py)."""
    n = helper.make_node
    return [n("Sigmoid", [gate], ["sig"]), n("Mul", [gate, "sig"], ["silu"]), n("Mul", ["silu", up], [out])]


SILU_MUL = OpContract(
    name="SiluMul",
    doc="Y = silu(gate) * up = gate * sigmoid(gate) * up (SwiGLU's epilogue); gate and up of one shape",
    inputs=(IO("gate", "[..., I]"), IO("up", "[..., I], gate's shape")),
    outputs=(IO("Y", "[..., I]"),),
    attrs=(),
    types=("float16", "bfloat16", "float"),
    body=lambda _opset: silu_mul_body(),  # Sigmoid and Mul: the same from opset 15 on
    reference=reference_silu_mul,
    kernel=KERNEL,
    specializations=_specs,
)
