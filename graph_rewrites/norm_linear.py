"""AddRMSNorm and the projections that read its output -> one op (contracts: ort_triton/ops/norm_linear.py).

    n, s = AddRMSNorm(x, skip, g);  y = MatMul(n, W [K, N])            ->  y, s = AddRMSNormLinear(x, skip, g, W^T)
    (or MatMul(n, Transpose(C [N, K])), a tied LM head: C as it is)
    n, s = AddRMSNorm(x, skip, g);  SiluMul(MatMul(n, Wg), MatMul(n, Wu))  ->  y, s = AddRMSNormSwiGLU(x, skip, g,
                                                                                        Wg^T, Wu^T)

Why: at decode the norm, each projection and SwiGLU's product are a launch each over a few kilobytes of
activations; fused, a layer's norm, packed Q/K/V and gate/up/SwiGLU are two launches that stream their weights
once (ort_triton/kernels/norm_linear.py). Beyond 16 rows the op runs the same steps as before (the norm, cuBLAS,
the product), so prefill keeps its GEMMs.

Why it is exact: the same roundings as the graph it replaces (the sum, the norm, each product; SiluMul from the
rounded gate and up) and the same dot products, accumulated in fp32 (the order of the sum differs from cuBLAS's).

Runs after every rule that reads a MatMul (packing: Llama's Q, K and V are one MatMul by then) and before
`linear` (stage 14), which would otherwise take these MatMuls. Refused, with a reason: a weight read elsewhere too
(storing it transposed would copy it), a weight of another type, a K that is not the norm's width, and (by the
matcher itself: "also used outside the fused region") a norm read by anything else. Not fused: RMSNorm without the
residual add (a model's first norm), whose input has no skip to fold.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from ort_triton.contract import DOMAIN
from ort_triton.ops.norm_linear import ADD_RMS_NORM_LINEAR, ADD_RMS_NORM_SWIGLU

from .common import NOT_A_CANDIDATE, other_perm, read_elsewhere, static_2d, transposed_constant


def _check_weight(result: pattern.MatchResult, x: ir.Value, w: ir.Value, k: int | None) -> pattern.MatchResult:
    """x: the norm's input (the norm's output has its type and shape); w: the constant the op reads (W, or C of a
    tied Transpose(C)); k: its K, None when its shape is not a static 2-D one."""
    if ir.convenience.get_const_tensor(w) is None:
        return result.fail(NOT_A_CANDIDATE + "the weight is computed", w)
    if k is None:
        return result.fail(f"the weight's shape {w.shape} is not a static 2-D one", w)
    if w.dtype != x.dtype:
        return result.fail(f"the weight is {w.dtype} but the norm is {x.dtype}", w)
    width = x.shape[-1] if x.shape is not None and x.shape.rank() >= 1 else None
    if not isinstance(width, int) or width != k:
        return result.fail(f"the norm's last dim {width} is not known to be the weight's K={k}", x)
    return result


def _eps(n: ir.Value) -> float:
    return n.producer().attributes.get_float("epsilon", 1e-6)


def _typed(values, x: ir.Value, n: int):
    y, s = values
    y.dtype = s.dtype = x.dtype
    if x.shape is not None:
        y.shape, s.shape = ir.Shape([*list(x.shape)[:-1], n]), ir.Shape(list(x.shape))
    return y, s


class AddRMSNormLinearRule(pattern.RewriteRuleClassBase):
    """MatMul(AddRMSNorm(x, skip, g), W) -> AddRMSNormLinear(x, skip, g, W^T)"""

    def __init__(self, name: str, *, tied: bool = False):
        super().__init__(name)
        self._tied = tied  # MatMul(n, Transpose(C)): C is W^T already

    def pattern(self, op, x, skip, gamma, w):
        n, s = op.AddRMSNorm(x, skip, gamma, _domain=DOMAIN, _outputs=["n", "s"], _allow_other_attributes=True)
        if self._tied:
            w = op.Transpose(w, _allow_other_attributes=True, _outputs=["wt_node"])
        return op.MatMul(n, w, _outputs=["y"]), s

    def check(self, context, x, n, w, wt_node=None, **_):
        result = pattern.MatchResult()
        read = wt_node if self._tied else w
        perm = None if wt_node is None else other_perm(wt_node.producer())
        if perm is not None:
            return result.fail(NOT_A_CANDIDATE + f"the Transpose's perm is {perm}", wt_node)
        dims = static_2d(w)
        result = _check_weight(result, x, w, None if dims is None else dims[1 if self._tied else 0])
        if not result:
            return result
        if read_elsewhere(read, None if self._tied else w):
            return result.fail("the weight is read elsewhere too: storing it transposed would copy it", read)
        return result

    def rewrite(self, op, x, skip, gamma, w, n, s, **_):
        wt = w if self._tied else transposed_constant(op, x.graph or n.graph, w)
        cols = static_2d(wt)[0]
        values = ADD_RMS_NORM_LINEAR.node(op, x, skip, gamma, wt, epsilon=_eps(n), outputs=[True, True])
        return _typed(values, x, cols)


class AddRMSNormSwiGLURule(pattern.RewriteRuleClassBase):
    """SiluMul(MatMul(AddRMSNorm(x, skip, g), Wg), MatMul(.., Wu)) -> AddRMSNormSwiGLU(x, skip, g, Wg^T, Wu^T)"""

    def pattern(self, op, x, skip, gamma, wg, wu):
        n, s = op.AddRMSNorm(x, skip, gamma, _domain=DOMAIN, _outputs=["n", "s"], _allow_other_attributes=True)
        gate = op.MatMul(n, wg, _outputs=["gate"])
        up = op.MatMul(n, wu, _outputs=["up"])
        return op.SiluMul(gate, up, _domain=DOMAIN, _outputs=["y"]), s

    def check(self, context, x, n, wg, wu, **_):
        result = pattern.MatchResult()
        dims = static_2d(wg)
        for w in (wg, wu):
            result = _check_weight(result, x, w, None if static_2d(w) is None else static_2d(w)[0])
            if not result:
                return result
        if static_2d(wu) != dims:
            return result.fail(f"the gate weight is {list(dims)} and the up weight {list(static_2d(wu))}", wu)
        for w in (wg, wu):
            if read_elsewhere(w, w):
                return result.fail("the weight is read elsewhere too: storing it transposed would copy it", w)
        return result

    def rewrite(self, op, x, skip, gamma, wg, wu, n, **_):
        graph = x.graph or n.graph
        wgt, wut = transposed_constant(op, graph, wg), transposed_constant(op, graph, wu)
        values = ADD_RMS_NORM_SWIGLU.node(op, x, skip, gamma, wgt, wut, epsilon=_eps(n), outputs=[True, True])
        return _typed(values, x, static_2d(wg)[1])
