"""A MatMul whose constant weight has rows that are not 16-byte aligned -> a Gemm on the transposed weight.

    MatMul(x [..., K], W [K, N])             ->  Reshape(Gemm(Reshape(x, [-1, K]), W^T [N, K], transB=1), [..., N])
    MatMul(x [..., K], Transpose(C [N, K]))  ->  the same with C itself as W^T (a tied lm_head: no copy)

Why: ORT runs MatMul(x, W) as a cuBLAS GEMM that reads W row by row, N elements apart. When N * element size
is not a multiple of 16 bytes (GPT-2's vocabulary, N = 50257) cuBLAS can only take its 1-element-aligned
kernels: on the H200, GPT-2 small's lm_head at prefill 8x512 ran cutlass's sm75 `..._align1` GEMM for 2.5 of
the step's 4.8 ms (bench/results/README.md, session 15). With the weight stored [N, K] and transB=1 the GEMM
reads both operands along K (768: aligned), as PyTorch's Linear does. Only the output rows stay N apart.

Why it is exact: a Reshape is a row-major reinterpretation and the GEMM works row by row, so row m of
Reshape(x, [M, K]) @ W is row m of the output, and the last Reshape lays the rows out along x's leading dims.
x's own rank-2 case needs no Reshape. The Transpose form needs perm [1, 0] (or none: the default reverses the
two dims). A weight that is also read elsewhere is refused (storing it transposed would copy it), as is one
whose K is unaligned too (nothing to gain), or an element type other than float, float16 and bfloat16.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from .common import fresh_name

_TYPES = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
_ALIGN = 16  # bytes: the vector loads cuBLAS's aligned kernels need at the start of every row


def _const(v: ir.Value | None) -> np.ndarray | None:
    t = ir.convenience.get_const_tensor(v) if v is not None else None
    return None if t is None else t.numpy()


def _is_const(v: ir.Value) -> bool:  # without reading a weight's data
    return ir.convenience.get_const_tensor(v) is not None


def _check(result: pattern.MatchResult, x: ir.Value, w_t_shape, const_ok: bool, weight: ir.Value):
    """w_t_shape: the weight as [N, K]; const_ok: whether it is a constant. Returns (result, (k, n))."""
    if x.dtype not in _TYPES:
        return result.fail(f"element type {x.dtype} is not one of float, float16, bfloat16", x), None
    if not const_ok:
        return result.fail("the weight is computed: transposing it would cost a Transpose every run", weight), None
    if weight.is_graph_output() or len(weight.uses()) > 1:
        return result.fail("the weight is read elsewhere too: storing it transposed would copy it", weight), None
    if x.shape is None or x.shape.rank() < 2:
        return result.fail(f"the input's shape {x.shape} is not known to have rank 2 or more", x), None
    n, k = w_t_shape
    size = x.dtype.itemsize
    if (n * size) % _ALIGN == 0:
        return result.fail(f"N={n}: the rows are {_ALIGN}-byte aligned already (cuBLAS's aligned kernels)",
                           weight), None
    if (k * size) % _ALIGN:
        return result.fail(f"K={k} is not {_ALIGN}-byte aligned either: the transposed weight gains nothing",
                           weight), None
    if isinstance(x.shape[-1], int) and x.shape[-1] != k:
        return result.fail(f"the input's last dim {x.shape[-1]} is not the weight's K={k}", x), None
    return result, (k, n)


def _gemm(op, x: ir.Value, w_t: ir.Value, k: int, n: int, out: ir.Value) -> ir.Value:
    graph = x.graph or w_t.graph
    lead = list(x.shape)[:-1]
    if len(lead) == 1:
        y = op.Gemm(x, w_t, transB=1)
    else:
        flat = op.Reshape(x, op.initializer(ir.tensor(np.array([-1, k], dtype=np.int64),
                                                      name=fresh_name(graph, f"{out.name}__ot_flat"))))
        y2 = op.Gemm(flat, w_t, transB=1)
        if all(isinstance(d, int) for d in lead):
            target = op.initializer(ir.tensor(np.array([*lead, n], dtype=np.int64),
                                              name=fresh_name(graph, f"{out.name}__ot_shape")))
        else:
            n_vec = op.initializer(ir.tensor(np.array([n], dtype=np.int64),
                                             name=fresh_name(graph, f"{out.name}__ot_n")))
            target = op.Concat(op.Shape(x, end=-1), n_vec, axis=0)
        y = op.Reshape(y2, target)
    y.dtype = x.dtype
    y.shape = ir.Shape([*lead, n])
    return y


class TransposedWeightRule(pattern.RewriteRuleClassBase):
    """MatMul(x, W [K, N]), N unaligned -> Reshape(Gemm(Reshape(x, [-1, K]), W^T, transB=1), [..., N])"""

    def pattern(self, op, x, w):
        return op.MatMul(x, w, _outputs=["out"])

    def check(self, context, x, w, **_):
        shape = (w.shape[1], w.shape[0]) if w.shape is not None and w.shape.rank() == 2 and all(
            isinstance(d, int) for d in w.shape) else None
        if shape is None:
            return pattern.MatchResult().fail(f"the weight's shape {w.shape} is not a static 2-D one", w)
        result, dims = _check(pattern.MatchResult(), x, shape, _is_const(w), w)
        self._dims = dims
        return result

    def rewrite(self, op, x, w, out, **_):
        k, n = self._dims
        w_t = op.initializer(ir.tensor(np.ascontiguousarray(_const(w).T),
                                       name=fresh_name(x.graph or w.graph, f"{w.name}__ot_transposed")))
        return _gemm(op, x, w_t, k, n, out)


class TransposedWeightOfTransposeRule(pattern.RewriteRuleClassBase):
    """MatMul(x, Transpose(C [N, K])), N unaligned -> Reshape(Gemm(Reshape(x, [-1, K]), C, transB=1), [..., N])"""

    def pattern(self, op, x, c):
        return op.MatMul(x, op.Transpose(c, _allow_other_attributes=True, _outputs=["w"]), _outputs=["out"])

    def check(self, context, x, c, w, **_):
        result = pattern.MatchResult()
        perm = w.producer().attributes.get("perm")
        if perm is not None and list(perm.as_ints()) != [1, 0]:
            return result.fail(f"the Transpose's perm is {list(perm.as_ints())}, not [1, 0]", w.producer())
        if c.shape is None or c.shape.rank() != 2 or not all(isinstance(d, int) for d in c.shape):
            return result.fail(f"the transposed weight's shape {c.shape} is not a static 2-D one", c)
        result, self._dims = _check(result, x, (c.shape[0], c.shape[1]), _is_const(c), w)
        return result

    def rewrite(self, op, x, c, out, **_):
        k, n = self._dims
        return _gemm(op, x, c, k, n, out)
