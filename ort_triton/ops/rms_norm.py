"""RMSNorm and AddRMSNorm: root-mean-square normalisation over the last axis, optionally after a residual add
(Llama, Mistral, Qwen2: `LlamaRMSNorm`).

    s   = X + skip                                   (AddRMSNorm only, rounded to X's type as the graph's
                                                      Add rounds it; also returned as `sum` if asked)
    ms  = sum(float(s)^2) / H                        (fp32, one pass: no mean is subtracted, nothing cancels)
    Y   = T(float(s) / sqrt(ms + epsilon) * float(gamma))    T = the element type of X

Everything after the residual add is fp32 and rounds once, at the end. HF's LlamaRMSNorm and the ONNX
RMSNormalization spec (opset 23) round the normalised value to T *before* multiplying by gamma (in T);
ORT's own RMSNormalization / SimplifiedLayerNormalization kernels round once, like this op (checked on ORT
1.31 CPU: fp16 RMSNormalization equals the single-rounding form bit for bit). For fp32 both orders are
the same; for fp16/bf16 they differ by about one unit in the last place of Y. The function body is the
decomposition above at every opset (not RMSNormalization at 23), so its meaning does not hang on how a
runtime reads that spec.

AddRMSNorm has no bias input: no output projection of the decoders it is for (o_proj, down_proj) has a
bias (Qwen2's biases are on q/k/v only), so a bias would always be a zero vector read for nothing.

One program normalises ROWS rows of BLOCK_H >= H columns held in registers (the kernel:
ort_triton/kernels/rms_norm.py), like LayerNorm's; rows whose start is 16-byte aligned (H % 16 == 0) get
a specialisation that lets Triton emit 16-byte vector loads.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..contract import IO, Attr, Kernel, OpContract, Spec, Tuning, attr_ref
from .tune_space import pow2_layout, random_inputs, row_spec, row_specs, row_tuning

MAX_HIDDEN = 16384
BLOCKS = (256, 1024, 2048, 4096, 8192, 16384)
layout = pow2_layout(BLOCKS)  # H -> {"BLOCK_H": the smallest block that holds it}


KERNEL = Kernel(
    module="ort_triton.kernels.rms_norm",
    fn_name="rms_norm_fwd",
    signature={"X": "*{T}", "R": "*{T}", "W": "*{T}", "Y": "*{T}", "S": "*{T}",
               "n_rows": "i32", "H": "i32", "eps": "fp32"},
    native_plan="ot_rms_norm_plan",
    native_params="ot_rms_norm_params",
    dispatch_keys=("store_sum", "h_div16", "H", "rows"),  # rows: only tuned specs narrow it
)


# (ROWS, num_warps) per (block width, mode) for any row count: COPIED from LayerNorm's table (ops/layer_norm.py,
# tuned on the H200 for fp16), not measured for RMSNorm (only at few rows and H = 2048: _LAUNCH_FEW below). The
# shapes are alike (one row stream in, one out, plus a residual stream and the sum); RMSNorm holds one [H] vector
# (gamma) where LayerNorm holds two or three, so these configs have at most the register pressure they had there.
# Re-sweep before trusting them.
_LAUNCH = {  # block: (plain, residual, residual+sum)
    256: ((8, 2), (8, 4), (8, 4)),
    1024: ((2, 2), (2, 4), (1, 4)),
    2048: ((1, 2), (1, 4), (1, 4)),
    4096: ((2, 4), (2, 16), (2, 16)),
    8192: ((1, 4), (2, 8), (1, 4)),
    16384: ((1, 8), (1, 16), (1, 16)),
}


# Up to FEW_ROWS rows (a decode step's 1-16 rows, a 512-token prefill), measured for RMSNorm: `ort-triton tune` of
# Llama-1B on the H200 (session 17, bench/results/session17/llama-1b.tuning.json; CUDA-graph replays of the kernel)
# picked 1 row x 8 warps at H = 2048 for the plain kernel (1.22x, 1.24x, 1.33x over (1, 2) at 512, 1 and 16 rows)
# and for the residual+sum one (1.06x, 1.10x, 1.10x over (1, 4)); the residual kernel without the sum kept (1, 4)
# at 16 and 512 rows (1.09x with 8 warps at 1 row alone). None: _LAUNCH's entry.
FEW_ROWS = 512
_LAUNCH_FEW = {2048: ((1, 8), None, (1, 8))}


def launch_config(block_h: int, has_res: bool = False, store_sum: bool = False,
                  n_rows: int | None = None) -> tuple[int, int]:
    """(ROWS, num_warps) for a block width, mode and row count (None: any, the config of the open-ended row
    range): _LAUNCH_FEW's entry up to FEW_ROWS rows where it has one, else _LAUNCH's."""
    mode = (1 + int(store_sum)) if has_res else 0
    few = _LAUNCH_FEW.get(block_h, (None, None, None))[mode]
    return few if few and n_rows is not None and n_rows <= FEW_ROWS else _LAUNCH[block_h][mode]


def _spec(has_res: bool, keys: tuple[tuple[int, int], ...], rows: int, warps: int) -> Spec:
    """The spec for the key ranges (tune_space.row_spec's, from the first)."""
    return row_spec(keys, 0, has_res=has_res, layout=layout, rows=rows, warps=warps,
                    pointers=("X", "R", "W", "Y", "S"))


def _specs(has_res: bool) -> list[Spec]:
    return row_specs((), has_res, BLOCKS, launch_config, _spec, row_split=FEW_ROWS)


# ---- tuning (ort-triton tune): (ROWS, num_warps) per exact H and power-of-two row bucket --------------
def _tune_run(has_res: bool):
    def run(type_name, shapes, attrs, store_sum, config, device):
        from ..kernels.rms_norm import rms_norm

        x_shape, h = shapes[0], shapes[0][-1]
        if has_res:
            _, (x, skip, gamma) = random_inputs(type_name, [x_shape, x_shape, [h]], device, 3)
        else:
            _, (x, gamma) = random_inputs(type_name, [x_shape, [h]], device, 2)
            skip = None
        y, s = x.new_empty(x.shape), (x.new_empty(x.shape) if store_sum else None)
        eps = float(attrs.get("epsilon", 1e-6))
        return lambda: rms_norm(x, gamma, skip, eps, store_sum, out=y, sum_out=s, config=config)
    return run


def _tuning(has_res: bool) -> Tuning:
    return row_tuning(prefix=(), has_res=has_res, layout=layout, launch_config=launch_config, make_spec=_spec,
                      run=_tune_run(has_res))


# ---- references (float64 numpy) ---------------------------------------------------------------------
def reference_rms_norm(x, gamma, epsilon=1e-6):
    s = np.asarray(x, np.float64)
    return (s / np.sqrt((s * s).mean(-1, keepdims=True) + epsilon) * np.asarray(gamma, np.float64),)


def reference_add_rms_norm(x, skip, gamma, epsilon=1e-6):
    s = np.asarray(x, np.float64) + np.asarray(skip, np.float64)
    return reference_rms_norm(s, gamma, epsilon)[0], s


# ---- function bodies -------------------------------------------------------------------------------
def rms_norm_body(x: str, opset: int, out: str = "Y") -> list[onnx.NodeProto]:
    """out = T(float(x) / sqrt(mean(float(x)^2) + epsilon) * float(gamma)) over the last axis, for `opset`
    (ReduceMean takes its axes as an attribute before 18, as an input from 18). Also the norm inside
    AddRMSNormLinear's and AddRMSNormSwiGLU's bodies (ops/norm_linear.py)."""
    n = helper.make_node
    eps = n("Constant", [], ["eps"])
    eps.attribute.append(attr_ref("epsilon", onnx.AttributeProto.FLOAT, name="value_float"))
    f = onnx.TensorProto.FLOAT
    if opset >= 18:
        mean = [n("Constant", [], ["axes"], value_ints=[-1]), n("ReduceMean", ["xx", "axes"], ["ms"], keepdims=1)]
    else:
        mean = [n("ReduceMean", ["xx"], ["ms"], axes=[-1], keepdims=1)]
    return [
        n("Cast", [x], ["xf"], to=f), n("Mul", ["xf", "xf"], ["xx"]), *mean, eps,
        n("Add", ["ms", "eps"], ["mse"]), n("Sqrt", ["mse"], ["rms"]), n("Div", ["xf", "rms"], ["normed"]),
        n("Cast", ["gamma"], ["gf"], to=f), n("Mul", ["normed", "gf"], ["yf"]), n("CastLike", ["yf", x], [out]),
    ]


_EPS = Attr("epsilon", "float", 1e-6, "added to the mean square before the square root")
_TYPES = ("float", "float16", "bfloat16")

RMS_NORM = OpContract(
    name="RMSNorm",
    doc="Y = X / sqrt(mean(X^2) + epsilon) * gamma over the last axis, in fp32, rounded once to X's type.",
    inputs=(IO("X", "[..., H]"), IO("gamma", "[H]")),
    outputs=(IO("Y", "[..., H]"),),
    attrs=(_EPS,),
    types=_TYPES,
    body=lambda opset: rms_norm_body("X", opset),
    reference=reference_rms_norm,
    kernel=KERNEL,
    specializations=lambda _t: _specs(has_res=False),
    tuning=_tuning(has_res=False),
)

ADD_RMS_NORM = OpContract(
    name="AddRMSNorm",
    doc="sum = X + skip; Y = RMSNorm(sum, gamma) over the last axis.",
    inputs=(IO("X", "[..., H]"), IO("skip", "same shape as X"), IO("gamma", "[H]")),
    outputs=(IO("Y", "[..., H]"), IO("sum", "X + skip, the residual stream that goes on", optional=True)),
    attrs=(_EPS,),
    types=_TYPES,
    body=lambda opset: [helper.make_node("Add", ["X", "skip"], ["sum"]), *rms_norm_body("sum", opset)],
    reference=reference_add_rms_norm,
    kernel=KERNEL,
    specializations=lambda _t: _specs(has_res=True),
    tuning=_tuning(has_res=True),
)
