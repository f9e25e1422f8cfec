"""Rotary: rotary position embedding (RoPE) applied to one of q or k, on the heads layout.

    X [B, N, S, D]                 q or k after the head transpose (where HF applies it)
    cos, sin [B', S', W] or [B', 1, S', W]   B' in {1, B}, S' in {1, S}: broadcast over the heads (and the batch)
    R = rotary_dim (0: D), even, R <= D: channels R..D-1 pass through unchanged (partial rotary)

    interleaved = 0 (HF Llama's rotate_half):  pairs (j, j + R/2)
        y[..., :R] = x[..., :R] * C + cat(-x[..., R/2:R], x[..., :R/2]) * S
    interleaved = 1 (GPT-J, ONNX interleaved): pairs (2i, 2i + 1)
        y[..., 2i]   = x[2i] C[2i] - x[2i+1] S[2i],    y[..., 2i+1] = x[2i+1] C[2i+1] + x[2i] S[2i+1]
    y[..., R:] = x[..., R:]

C and S hold one value per rotated channel: W = R takes cos/sin as given (HF computes them per channel,
cos = cat(freqs, freqs).cos()); W = R/2 holds one value per pair (ONNX RotaryEmbedding's caches), which
channel j reads at j mod R/2 (half-split) or j // 2 (interleaved). Taking both widths and both ranks
as the graph has them means no node is added in front of the op: HF's exports feed it the [B', 1, S, R]
Unsqueeze that their decomposed form multiplies with; ONNX RotaryEmbedding its [B, S, R/2] caches.

The function body computes it in stock ops without control flow, for every attribute value: the pair
partner p(j) and its sign as int64 index arithmetic on Range(R), x[..., p(j)] by Gather, C by Gather of
cos at its channel index. For the decomposed HF form it is the original's arithmetic, operand for
operand (x * C + (-x2 | x1) * S), so a fused model on ORT CPU gives the original's bits.

The kernel (ort_triton/kernels/rotary.py): one program per (s-block, head, batch) tile of BLOCK_S rows of
BLOCK_D >= D channels, reading X once at the channels and once at their partners (the same cache lines),
cos and sin at their channel index, math in fp32; D up to 256. Where the pairs are half-split and R = D =
BLOCK_D (Llama, Qwen, Gemma, Mistral: D = 64, 128 or 256), a spec of its own reads each row as its two
halves at constant offsets instead, so its loads are vectors (session 28's SASS audit: the general
indexing leaves 2-byte scalar loads).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import helper

from ..contract import IO, Attr, Kernel, OpContract, Spec, attr_ref, renamed

MAX_HEAD_DIM = 256
BLOCK_DS = (32, 64, 128, 256)
# Elements per program: BLOCK_S = TILE // BLOCK_D rows. 2048 (16 rows at D=128) spilled 8-24 bytes in the
# fp16 aligned specs on sm_80/sm_90 at 4 warps (ptxas capped them at 80 registers); at 1024 none spills, and
# a decode step (S = 1) leaves fewer rows of a tile idle. A first choice, to be swept on the GPU.
TILE = 1024
# The half-split specs' (rope_halves) tile: at 1024 a thread holds 4 fp16 of each half (64-bit loads), at 2048 8
# (128-bit). Session 29, scripts/rotary_micro.py on an H100 (QKVRotaryCache / QKVNormRotaryCache as the specs
# compile): 2048 was 2-16% faster than 1024 at prefill (Llama-1B and Qwen3-0.6B shapes, 512 and 4096 rows), and
# within 2% at decode; 4096 no better.
HALF_TILE = 2048
NUM_WARPS = 4

KERNEL = Kernel(
    module="ort_triton.kernels.rotary",
    fn_name="rotary_fwd",
    signature={"X": "*{T}", "COS": "*{T}", "SIN": "*{T}", "Y": "*{T}", "N": "i32", "S": "i32", "D": "i32",
               "R": "i32", "cos_b": "i32", "cos_s": "i32", "per_pair": "i32", "interleaved": "i32"},
    native_plan="ot_rotary_plan",
    native_params="ot_rotary_params",
    dispatch_keys=("head_dim", "aligned", "half_split"),
)


def block_s(block_d: int, half: int = 0) -> int:
    """BLOCK_S, the rows a program: of the half-split spec where half is set."""
    return (HALF_TILE if half else TILE) // block_d


def half_split(d: int, r: int, w: int, interleaved: int) -> int:
    """1 where the half-split spec runs a launch (kernels/rotary.py's rope_halves): pairs (j, j + R/2), R = D and
    D one of BLOCK_DS (then D and W = R or R/2 are multiples of 16, the aligned key). The native planners'
    half_split key is (not interleaved and R = D); the spec's head_dim range [D, D] adds the rest."""
    return int(not interleaved and r == d and d in BLOCK_DS and w in (r, r // 2))


def rope_specs(pointers: tuple[str, ...], constexprs: dict | None = None, consts: tuple[int, ...] = (),
               half: bool = True) -> list[Spec]:
    """Per BLOCK_D (head dims up to it): with half, first the half-split spec for D = BLOCK_D (half_split), then
    two specs: the first where D and the cos/sin row width W are multiples of 16 (then every row of X, Y, cos
    and sin starts 16-byte aligned: vector loads), the second for any. The planner takes the first that fits.
    Keys (head_dim, aligned[, half_split]). First choices, to be swept on the GPU.
    For every kernel built on rope_rows: pointers are its pointer arguments; constexprs and consts, its own
    beyond (BLOCK_S, BLOCK_D); half: the kernel has the HALF_SPLIT constexpr (QKVCache's has no rotation)."""
    specs, lo = [], 1
    for bd in BLOCK_DS:
        for split, aligned in ((1, 1), (0, 1), (0, 0)) if half else ((0, 1), (0, 0)):
            keys = ((bd if split else lo, bd), (aligned, 1)) + (((split, 1),) if half else ())
            specs.append(Spec(constexprs={"BLOCK_S": block_s(bd, split), "BLOCK_D": bd, **(constexprs or {}),
                                          **({"HALF_SPLIT": split} if half else {})},
                              num_warps=NUM_WARPS, keys=keys, consts=(block_s(bd, split), bd, *consts),
                              divisible_by_16=pointers + (("D", "cos_b", "cos_s") if aligned else ())))
        lo = bd + 1
    return specs


def _specs(_type_name: str, x_bsnd: bool = False) -> list[Spec]:
    """x_bsnd: TransposeRotary's, X read as [B, S, N, D]."""
    return rope_specs(("X", "COS", "SIN", "Y"), {"X_BSND": int(x_bsnd)})


def reference_rotary(x, cos, sin, interleaved=0, rotary_dim=0):
    """float64 numpy reference, written as the two models write it (not as the body or kernel index it)."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    r = int(rotary_dim) or d
    cs = []
    for t in (cos, sin):
        t = np.asarray(t, np.float64)
        t = t.reshape(t.shape[0], 1, t.shape[-2], t.shape[-1])  # [B', S', W] or [B', 1, S', W]
        if t.shape[-1] * 2 == r:  # one value per pair
            t = np.repeat(t, 2, axis=-1) if interleaved else np.concatenate([t, t], axis=-1)
        assert t.shape[-1] == r, (t.shape, r)
        cs.append(t)
    c, s = cs
    xr, xp = x[..., :r], x[..., r:]
    if interleaved:
        rot = np.stack([-xr[..., 1::2], xr[..., 0::2]], axis=-1).reshape(xr.shape)
    else:
        rot = np.concatenate([-xr[..., r // 2:], xr[..., : r // 2]], axis=-1)
    return (np.concatenate([xr * c + rot * s, xp], axis=-1),)


def reference_transpose_rotary(x, cos, sin, interleaved=0, rotary_dim=0):
    """TransposeRotary: Rotary of X [B, S, N, D] moved to [B, N, S, D]."""
    return reference_rotary(np.swapaxes(np.asarray(x), 1, 2), cos, sin, interleaved, rotary_dim)


def _body(_opset: int, x: str = "X") -> list[onnx.NodeProto]:
    """Valid from opset 15 (Shape's start/end attributes, CastLike-free: every constant is int64 or taken
    from the inputs). Index arithmetic on j = Range(R), see the module docstring. x: the [B, N, S, D] value
    the nodes read (TransposeRotary's body transposes its X into it first)."""
    n = helper.make_node
    ints = lambda name, vals: n("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64,
                                                                                 [len(vals)], vals))
    scalar = lambda name, v: n("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64, [], [v]))
    r_attr = n("Constant", [], ["r_attr"])
    r_attr.attribute.append(attr_ref("rotary_dim", onnx.AttributeProto.INT, name="value_int"))
    il_attr = n("Constant", [], ["il_attr"])
    il_attr.attribute.append(attr_ref("interleaved", onnx.AttributeProto.INT, name="value_int"))
    return [
        r_attr, il_attr, scalar("zero", 0), scalar("one", 1), scalar("two", 2),
        ints("ax_last", [-1]), ints("start0", [0]), ints("end_max", [np.iinfo(np.int64).max]), ints("one1", [1]),
        n("Cast", ["il_attr"], ["il"], to=onnx.TensorProto.BOOL),
        # R: the attribute, D where it is 0
        n("Shape", [x], ["d1"], start=-1), n("Squeeze", ["d1"], ["d"]),
        n("Equal", ["r_attr", "zero"], ["r_default"]), n("Where", ["r_default", "d", "r_attr"], ["R"]),
        n("Div", ["R", "two"], ["half"]), n("Reshape", ["R", "one1"], ["R1"]),
        n("Range", ["zero", "R", "one"], ["j"]), n("Mod", ["j", "two"], ["j_odd"]),
        # partner p(j), and whether it enters negated: where j's flag (second half / odd) is 0 (a Where on
        # int64: ORT CPU has no boolean Where)
        n("Add", ["j", "half"], ["j_up"]), n("Mod", ["j_up", "R"], ["p_half"]),             # (j + R/2) mod R
        n("Add", ["j", "one"], ["j1"]), n("Mul", ["j_odd", "two"], ["j_odd2"]),
        n("Sub", ["j1", "j_odd2"], ["p_pair"]),                                              # j xor 1
        n("Div", ["j", "half"], ["j_high"]),                                                 # j >= R/2
        n("Where", ["il", "p_pair", "p_half"], ["p"]), n("Where", ["il", "j_odd", "j_high"], ["flag"]),
        n("Equal", ["flag", "zero"], ["neg"]),             # -x2 in the first half; -x[2i+1] at even j
        # the cos/sin channel index: j, or one value per pair (W = R/2)
        n("Shape", ["cos"], ["w1"], start=-1), n("Squeeze", ["w1"], ["w"]), n("Equal", ["w", "R"], ["per_channel"]),
        n("Div", ["j", "two"], ["c_pair"]), n("Mod", ["j", "half"], ["c_half"]),
        n("Where", ["il", "c_pair", "c_half"], ["c_of_pair"]), n("Where", ["per_channel", "j", "c_of_pair"], ["cidx"]),
        # cos, sin -> [B', 1, S', W] (from rank 3 or 4), each by its own shape -> [B', 1, S', R]
        *[node for t, out in (("cos", "C"), ("sin", "S")) for node in (
            n("Shape", [t], [f"{t}_b"], end=1), n("Shape", [t], [f"{t}_sw"], start=-2),
            n("Concat", [f"{t}_b", "one1", f"{t}_sw"], [f"{t}_shape"], axis=0),
            n("Reshape", [t, f"{t}_shape"], [f"{t}4"]), n("Gather", [f"{t}4", "cidx"], [out], axis=-1))],
        # y = x_r * C + rot(x_r) * S, then the channels past R unchanged
        n("Slice", [x, "start0", "R1", "ax_last"], ["xr"]), n("Slice", [x, "R1", "end_max", "ax_last"], ["xp"]),
        n("Gather", ["xr", "p"], ["xg"], axis=-1), n("Neg", ["xg"], ["xg_neg"]),
        n("Where", ["neg", "xg_neg", "xg"], ["rot"]),
        n("Mul", ["xr", "C"], ["xc"]), n("Mul", ["rot", "S"], ["rs"]), n("Add", ["xc", "rs"], ["yr"]),
        n("Concat", ["yr", "xp"], ["Y"], axis=-1),
    ]


def rotary_body(opset: int, x: str, y: str, prefix: str) -> list[onnx.NodeProto]:
    """Rotary's body reading `x` and writing `y`, its other values renamed with `prefix`: for a body that
    rotates more than one tensor (QKVRotaryCache's q and k) with the function's cos, sin and attributes."""
    return renamed(_body(opset, x), prefix, {"Y": y})


ROTARY = OpContract(
    name="Rotary",
    doc="Rotary position embedding on X [B, N, S, D] with cos, sin [B'(, 1), S', W], W = R or R/2; "
        "interleaved 0: rotate_half pairs (j, j + R/2), 1: pairs (2i, 2i + 1); channels past R unchanged.",
    inputs=(IO("X", "[B, N, S, D]"), IO("cos", "[B', S', W] or [B', 1, S', W]; B' in {1, B}, S' in {1, S}"),
            IO("sin", "cos's shape")),
    outputs=(IO("Y", "[B, N, S, D]"),),
    attrs=(Attr("interleaved", "int", 0, "0: rotate_half (HF Llama), 1: adjacent pairs (GPT-J)"),
           Attr("rotary_dim", "int", 0, "R, the rotated channels (even, <= D); 0: all of D")),
    types=("float16", "bfloat16", "float"),
    body=_body,
    reference=reference_rotary,
    kernel=KERNEL,
    specializations=_specs,
)


# Rotary where HF's graph applies it, after the head transpose: Q and K come from their projection as
# [B, S, N, D]; reading them in that layout saves the Transpose's launch and its pass over them (a decode
# step's Transposes are launch-bound: two a layer). The same kernel (X_BSND), planner and params code.
TRANSPOSE_ROTARY = OpContract(
    name="TransposeRotary",
    doc="Rotary(Transpose(X, perm=[0, 2, 1, 3])): X [B, S, N, D] (heads not yet transposed), Y [B, N, S, D]; "
        "cos, sin and the attributes as Rotary's.",
    inputs=(IO("X", "[B, S, N, D]"), *ROTARY.inputs[1:]),  # cos, sin
    outputs=ROTARY.outputs,
    attrs=ROTARY.attrs,
    types=ROTARY.types,
    body=lambda opset: [helper.make_node("Transpose", ["X"], ["X_bnsd"], perm=[0, 2, 1, 3]), *_body(opset, "X_bnsd")],
    reference=reference_transpose_rotary,
    kernel=dataclasses.replace(KERNEL, native_plan="ot_transpose_rotary_plan",
                               native_params="ot_transpose_rotary_params"),
    specializations=lambda t: _specs(t, x_bsnd=True),
)
