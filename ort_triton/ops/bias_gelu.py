"""BiasGelu and BiasGeluTanh: the epilogue of an MLP's first GEMM, y = gelu(x + bias).

    erf form:   gelu(s) = 0.5 * s * (1 + erf(s / sqrt(2)))
    tanh form:  gelu(s) = 0.5 * s * (1 + tanh(sqrt(2 / pi) * (s + 0.044715 * s^3)))

The GEMM itself stays ORT's MatMul (cuBLAS) until a Triton GEMM with this epilogue beats it on the GPU;
fusing the bias add and the activation already saves a full read and write of the [rows, 4H] tensor.
Elementwise and memory-bound: 2 tensors move (x in, y out); math in fp32. The kernel is
ort_triton/kernels/bias_gelu.py: a 2-D grid of (ROWS x BLOCK_H) tiles, so the bias is loaded once per
tile and no per-element modulo is needed.

BiasGeluMul and BiasGeluTanhMul: the same times a third tensor, y = gelu(x + bias) * up, GeGLU's epilogue
(Gemma: down(gelu_tanh(gate(x)) * up(x))) between its GEMMs. One pass over [rows, H] (x and up in, y out) for
the two the unfused graph makes (the activation, then the Mul: 5 tensor reads and writes); fp32 inside,
rounded once.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from ..contract import IO, Kernel, OpContract, Spec, renamed

BLOCK_H = 1024
ROWS = 4
NUM_WARPS = 4

KERNEL = Kernel(
    module="ort_triton.kernels.bias_gelu",
    fn_name="bias_gelu_fwd",
    signature={"X": "*{T}", "B": "*{T}", "Y": "*{T}", "n_rows": "i32", "H": "i32"},
    native_plan="ot_bias_gelu_plan",
    native_params="ot_bias_gelu_params",
    dispatch_keys=("h_div16",),
)


MUL_KERNEL = Kernel(
    module="ort_triton.kernels.bias_gelu",
    fn_name="bias_gelu_mul_fwd",
    signature={"X": "*{T}", "B": "*{T}", "U": "*{T}", "Y": "*{T}", "n_rows": "i32", "H": "i32"},
    native_plan="ot_bias_gelu_mul_plan",
    native_params="ot_bias_gelu_mul_params",
    dispatch_keys=("h_div16",),
)


def _specs(tanh: bool, mul: bool = False) -> list[Spec]:
    pointers = ("X", "B", "U", "Y") if mul else ("X", "B", "Y")
    return [Spec(constexprs={"TANH": int(tanh), "BLOCK_H": BLOCK_H, "ROWS": ROWS}, num_warps=NUM_WARPS,
                 keys=((aligned, 1),), consts=(ROWS, BLOCK_H),
                 divisible_by_16=pointers + (("H",) if aligned else ()))
            for aligned in (1, 0)]  # aligned first: the planner takes the first spec that fits


def reference_bias_gelu(x, bias, tanh=False):
    s = np.asarray(x, np.float64) + np.asarray(bias, np.float64)
    if tanh:
        return (0.5 * s * (1 + np.tanh(math.sqrt(2 / math.pi) * (s + 0.044715 * s**3))),)
    from math import erf

    return (0.5 * s * (1 + np.vectorize(erf)(s / math.sqrt(2))),)


def _body(tanh: bool) -> list[onnx.NodeProto]:
    n = helper.make_node
    c = lambda name, v: [n("Constant", [], [name + "_f"], value_float=v), n("CastLike", [name + "_f", "X"], [name])]
    nodes = [n("Add", ["X", "bias"], ["s"]), *c("half", 0.5), *c("one", 1.0)]
    if tanh:
        nodes += [*c("k0", math.sqrt(2 / math.pi)), *c("k1", 0.044715),
                  n("Mul", ["s", "s"], ["s2"]), n("Mul", ["s2", "s"], ["s3"]), n("Mul", ["s3", "k1"], ["cub"]),
                  n("Add", ["s", "cub"], ["inner"]), n("Mul", ["inner", "k0"], ["arg"]), n("Tanh", ["arg"], ["t"])]
    else:
        nodes += [*c("rsqrt2", 1 / math.sqrt(2)), n("Mul", ["s", "rsqrt2"], ["arg"]), n("Erf", ["arg"], ["t"])]
    return nodes + [n("Add", ["t", "one"], ["t1"]), n("Mul", ["s", "t1"], ["st"]), n("Mul", ["st", "half"], ["Y"])]


def _contract(name: str, tanh: bool, doc: str) -> OpContract:
    return OpContract(
        name=name, doc=doc,
        inputs=(IO("X", "[..., H]"), IO("bias", "[H]")),
        outputs=(IO("Y", "[..., H]"),),
        attrs=(),
        types=("float16", "bfloat16", "float"),
        body=lambda _opset: _body(tanh),  # Add, Mul, Erf, Tanh, CastLike: all there from opset 15
        reference=lambda x, bias: reference_bias_gelu(x, bias, tanh),
        kernel=KERNEL,
        specializations=lambda _t: _specs(tanh),
    )


BIAS_GELU = _contract("BiasGelu", False, "Y = gelu(X + bias), erf form")
BIAS_GELU_TANH = _contract("BiasGeluTanh", True, "Y = gelu(X + bias), tanh approximation")


def reference_bias_gelu_mul(x, bias, up, tanh=False):
    return (reference_bias_gelu(x, bias, tanh)[0] * np.asarray(up, np.float64),)


def _mul_body(tanh: bool) -> list[onnx.NodeProto]:
    """BiasGelu[Tanh]'s body into `act`, then act * up: the unfused graph's two ops."""
    return [*renamed(_body(tanh), "", {"Y": "act"}), helper.make_node("Mul", ["act", "up"], ["Y"])]


def _mul_contract(name: str, tanh: bool, doc: str) -> OpContract:
    return OpContract(
        name=name, doc=doc,
        inputs=(IO("X", "[..., H]"), IO("bias", "[H]"), IO("up", "[..., H], X's shape")),
        outputs=(IO("Y", "[..., H]"),),
        attrs=(),
        types=("float16", "bfloat16", "float"),
        body=lambda _opset: _mul_body(tanh),
        reference=lambda x, bias, up: reference_bias_gelu_mul(x, bias, up, tanh),
        kernel=MUL_KERNEL,
        specializations=lambda _t: _specs(tanh, mul=True),
    )


BIAS_GELU_MUL = _mul_contract("BiasGeluMul", False, "Y = gelu(X + bias) * up, erf form (GeGLU's epilogue)")
BIAS_GELU_TANH_MUL = _mul_contract("BiasGeluTanhMul", True, "Y = gelu(X + bias) * up, tanh approximation (GeGLU's "
                                   "epilogue: Gemma)")
