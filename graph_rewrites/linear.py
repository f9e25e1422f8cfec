"""A MatMul by a constant weight -> Linear on the weight stored transposed (contract: ort_triton/ops/linear.py).

    MatMul(x [..., K], W [K, N])             ->  Linear(x, W^T [N, K])      (W^T a new constant; W dropped)
    MatMul(x [..., K], Transpose(C [N, K]))  ->  Linear(x, C)               (a tied LM head: C as it is)

Why: a decode step is a few rows times every weight, and Linear runs up to 16 rows through Triton kernels that
stream the weight's rows (ort_triton/kernels/gemv.py); with more rows it runs the cuBLAS GEMM ORT's MatMul runs.

Why it is exact: the same dot products over the same K terms, accumulated in fp32 and rounded once, as cuBLAS
does (the order of the sum differs). The Transpose form needs perm [1, 0] (or none: for two dims the default
reverses them).

Last of the rules (stage 14): every rule that reads a MatMul (bias folds, attention, packing, padded_weight)
sees it as exported, and a padded weight is taken as padded (its Slice stays after the Linear). Refused: a
weight also read elsewhere (storing it transposed would copy it), an element type other than float, float16 and
bfloat16, x's last dim known and not K. Not candidates (common.NOT_A_CANDIDATE): a computed weight (attention's
products), one not a static 2-D shape.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from ort_triton.ops.linear import LINEAR

from .common import FLOAT_TYPES, NOT_A_CANDIDATE, other_perm, read_elsewhere, static_2d, transposed_constant


def _check(result: pattern.MatchResult, x: ir.Value, k: int, constant: ir.Value, read: ir.Value,
           copied: bool) -> pattern.MatchResult:
    """k: the weight's K; constant: the initializer Linear reads (W, or C of Transpose(C)); read: the value the
    MatMul reads; copied: whether the rewrite stores a transposed copy of the constant."""
    if ir.convenience.get_const_tensor(constant) is None:  # activations x activations (attention's products)
        return result.fail(NOT_A_CANDIDATE + "the weight is computed", constant)
    if x.dtype not in FLOAT_TYPES:
        return result.fail(f"element type {x.dtype} is not one of float, float16, bfloat16", x)
    if constant.dtype != x.dtype:
        return result.fail(f"the weight is {constant.dtype} but the input is {x.dtype}", constant)
    if read_elsewhere(read, constant if copied else None):
        return result.fail("the weight is read elsewhere too: storing it transposed would copy it", read)
    if x.shape is None or x.shape.rank() < 1:
        return result.fail(f"the input's shape {x.shape} is not known to have rank 1 or more", x)
    if isinstance(x.shape[-1], int) and x.shape[-1] != k:
        return result.fail(f"the input's last dim {x.shape[-1]} is not the weight's K={k}", x)
    return result


def _linear(op, x: ir.Value, wt: ir.Value, n: int) -> ir.Value:
    y = LINEAR.node(op, x, wt)
    y.dtype = x.dtype
    y.shape = ir.Shape([*list(x.shape)[:-1], n])
    return y


class LinearRule(pattern.RewriteRuleClassBase):
    """MatMul(x, W [K, N]) -> Linear(x, W^T)"""

    def pattern(self, op, x, w):
        return op.MatMul(x, w, _outputs=["out"])

    def check(self, context, x, w, **_):
        if static_2d(w) is None:  # a batched MatMul (attention's), or an unknown shape
            return pattern.MatchResult().fail(NOT_A_CANDIDATE + f"the weight's shape {w.shape} is not a static "
                                              "2-D one", w)
        return _check(pattern.MatchResult(), x, static_2d(w)[0], w, w, copied=True)

    def rewrite(self, op, x, w, out, **_):
        return _linear(op, x, transposed_constant(op, x.graph or out.graph, w), static_2d(w)[1])


class LinearOfTransposeRule(pattern.RewriteRuleClassBase):
    """MatMul(x, Transpose(C [N, K])) -> Linear(x, C)"""

    def pattern(self, op, x, c):
        return op.MatMul(x, op.Transpose(c, _allow_other_attributes=True, _outputs=["w"]), _outputs=["out"])

    def check(self, context, x, c, w, **_):
        result = pattern.MatchResult()
        perm = other_perm(w.producer())
        if perm is not None:
            return result.fail(NOT_A_CANDIDATE + f"the Transpose's perm is {perm}, not [1, 0]",
                               w.producer())  # attention's K^T
        if static_2d(c) is None:
            return result.fail(NOT_A_CANDIDATE + f"the transposed weight's shape {c.shape} is not a static 2-D "
                               "one", c)
        # C itself may be read elsewhere (a tied embedding's Gather): Linear reads it as it is, no copy
        return _check(result, x, static_2d(c)[1], c, w, copied=False)

    def rewrite(self, op, x, c, **_):
        return _linear(op, x, c, static_2d(c)[0])
