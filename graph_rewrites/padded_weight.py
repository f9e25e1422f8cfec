"""A MatMul whose constant weight has rows that are not 16-byte aligned -> a MatMul on the weight padded with
zero columns, then a Slice back to N.

    MatMul(x [..., K], W [K, N])             ->  Slice(MatMul(x, [W | 0] [K, N']), ends=[N], axes=[-1])
    MatMul(x [..., K], Transpose(C [N, K]))  ->  the same with [C^T | 0] (a tied lm_head: C stays for its Gather)

N' is N rounded up to a multiple of 8 elements, 16 bytes in fp16 and bf16 (GPT-2: 50257 -> 50264), so that an
fp32 model stays aligned when `--float16` converts it.

Why: ORT runs MatMul(x, W) as a cuBLAS GEMM that writes rows of N elements and reads W's rows N elements apart.
When N * element size is not a multiple of 16 bytes (GPT-2's vocabulary, N = 50257) cuBLAS can only take its
1-element-aligned kernels: on the H200, GPT-2 small's lm_head at prefill 8x512 ran cutlass's sm75
`..._align1` GEMM for 2.5 of the step's 4.8 ms (bench/results/README.md, session 15). Storing the weight
transposed (a Gemm with transB=1, PyTorch Linear's layout) was measured slower still (0.87x, session 16): the
output rows stay N apart. Padding N aligns both, as PyTorch Inductor's matmul padding does; the Slice costs one
copy of the output (at prefill 8x512 fp16, 412 MB each way: ~0.2 ms on the H200 against ~2 ms saved).

Why it is exact: the padded columns are zero weights whose outputs the Slice drops; every kept output is the
same dot product over the same K terms. The Transpose form needs perm [1, 0] (or none: the default reverses
the two dims). Refused: a weight (or Transpose) also read elsewhere (padding would copy it), a K that is
unaligned too (x's rows would still be unaligned: nothing to gain), an element type other than float, float16
and bfloat16, an input of rank < 2. Not candidates at all (common.NOT_A_CANDIDATE: `optimize -v` lists
none of them): an aligned N (nearly every MatMul), an N under MIN_N (a small GEMM, whatever its kernel), a
computed or not 2-D weight.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from .common import FLOAT_TYPES, NOT_A_CANDIDATE, fresh_name, other_perm, read_elsewhere, static_2d

_ALIGN = 16  # bytes: the vector loads cuBLAS's aligned kernels need at the start of every row
# N is padded to a multiple of 16 bytes of a 2-byte type: aligned in fp16 and bf16, and in an fp32 model too,
# before and after `ort-triton optimize --float16` converts it (a multiple of 4 elements would be unaligned
# there again).
_ELEMS = _ALIGN // 2
# Below this N the GEMM is small whatever kernel runs it, and the Slice's launch would cost more than it saves
# (a classifier's 2 or 3 labels); GPT-2's lm_head is 50257 wide.
MIN_N = 4096


def _check(result: pattern.MatchResult, x: ir.Value, k: int, n: int, weight: ir.Value, read: ir.Value):
    """k, n: the weight as [K, N]; weight: the constant to pad; read: the value the MatMul reads (the weight
    itself or its Transpose, whose C may be read elsewhere: ORT would fold C^T into a copy anyway).
    Returns (result, padded N)."""
    if x.dtype not in FLOAT_TYPES:
        return result.fail(f"element type {x.dtype} is not one of float, float16, bfloat16", x), None
    if ir.convenience.get_const_tensor(weight) is None:  # activations x activations (attention's products)
        return result.fail(NOT_A_CANDIDATE + "the weight is computed: padding it would cost a Pad every run",
                           weight), None
    if read_elsewhere(read):  # a tied C gathered elsewhere is fine: ORT folds C^T anyway
        return result.fail("the weight is read elsewhere too: padding it would copy it", read), None
    if x.shape is None or x.shape.rank() < 2:
        return result.fail(f"the input's shape {x.shape} is not known to have rank 2 or more", x), None
    size = int(x.dtype.itemsize)
    if n % _ELEMS == 0:  # nearly every MatMul
        return result.fail(NOT_A_CANDIDATE + f"N={n}: the rows are {_ALIGN}-byte aligned already, in fp16 too "
                           "(cuBLAS's aligned kernels)", weight), None
    if n < MIN_N:
        return result.fail(NOT_A_CANDIDATE + f"N={n} < {MIN_N}: a GEMM this narrow gains less than the Slice's "
                           "launch costs", weight), None
    if (k * size) % _ALIGN:
        return result.fail(f"K={k} is not {_ALIGN}-byte aligned either: padding N gains nothing", weight), None
    if isinstance(x.shape[-1], int) and x.shape[-1] != k:
        return result.fail(f"the input's last dim {x.shape[-1]} is not the weight's K={k}", x), None
    return result, -(-n // _ELEMS) * _ELEMS


def _padded_matmul(op, x: ir.Value, w_kn: np.ndarray, n_pad: int, base: str, out: ir.Value) -> ir.Value:
    graph = x.graph or out.graph
    k, n = w_kn.shape
    padded = np.zeros((k, n_pad), dtype=w_kn.dtype)
    padded[:, :n] = w_kn
    w = op.initializer(ir.tensor(padded, name=fresh_name(graph, f"{base}__ot_padded")))
    y_pad = op.MatMul(x, w)
    ints = lambda tag, v: op.initializer(ir.tensor(np.array(v, dtype=np.int64),
                                                   name=fresh_name(graph, f"{out.name}__ot_{tag}")))
    y = op.Slice(y_pad, ints("start", [0]), ints("end", [n]), ints("axis", [-1]))
    y.dtype = x.dtype
    y.shape = ir.Shape([*list(x.shape)[:-1], n])
    return y


class PaddedWeightRule(pattern.RewriteRuleClassBase):
    """MatMul(x, W [K, N]), N unaligned -> Slice(MatMul(x, [W | 0] [K, N']), ends=[N], axes=[-1])"""

    def pattern(self, op, x, w):
        return op.MatMul(x, w, _outputs=["out"])

    def check(self, context, x, w, **_):
        dims = static_2d(w)
        if dims is None:  # a batched MatMul (attention's), or an unknown shape
            return pattern.MatchResult().fail(NOT_A_CANDIDATE + f"the weight's shape {w.shape} is not a static "
                                              "2-D one", w)
        result, self._n_pad = _check(pattern.MatchResult(), x, dims[0], dims[1], w, w)
        return result

    def rewrite(self, op, x, w, out, **_):
        return _padded_matmul(op, x, ir.convenience.get_const_tensor(w).numpy(), self._n_pad, w.name, out)


class PaddedWeightOfTransposeRule(pattern.RewriteRuleClassBase):
    """MatMul(x, Transpose(C [N, K])), N unaligned -> Slice(MatMul(x, [C^T | 0] [K, N']), ends=[N], axes=[-1])"""

    def pattern(self, op, x, c):
        return op.MatMul(x, op.Transpose(c, _allow_other_attributes=True, _outputs=["w"]), _outputs=["out"])

    def check(self, context, x, c, w, **_):
        result = pattern.MatchResult()
        perm = other_perm(w.producer())
        if perm is not None:
            return result.fail(NOT_A_CANDIDATE + f"the Transpose's perm is {perm}, not [1, 0]",
                               w.producer())  # attention's K^T
        dims = static_2d(c)
        if dims is None:
            return result.fail(NOT_A_CANDIDATE + f"the transposed weight's shape {c.shape} is not a static 2-D "
                               "one", c)
        result, self._n_pad = _check(result, x, dims[1], dims[0], c, w)
        return result

    def rewrite(self, op, x, c, out, **_):
        return _padded_matmul(op, x, ir.convenience.get_const_tensor(c).numpy().T, self._n_pad, c.name, out)
