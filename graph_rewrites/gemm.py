"""A Gemm between two Reshapes (GPT-2's Conv1D, both exporters) -> MatMul + Add on the unflattened input.

    Reshape(Gemm(Reshape(x, [-1, K]), W [K, N], b [N]), T = [..., N])  ->  Add(MatMul(x', W), b)

Why: the Gemm hides the bias from the rules that fold a MatMul's bias Add into what follows it
(bias_gelu, bias_add_layer_norm) and its Reshapes hide the projection from the attention rules. The bias
inside the Gemm is not free either: ORT's CUDA Gemm first writes b broadcast over the whole [M, N] output
(a K=1 cuBLAS GEMM with a ones vector) and the main GEMM then reads it back (beta=1): a full write and
read of the output and a launch, what a separate Add costs. Folded into BiasGelu/AddLayerNorm, which read
the activation anyway, it costs nothing. Stage 1, so stages 2-6 see MatMul + Add.

Why it is exact. A Reshape is a row-major reinterpretation, and the Gemm works row by row: row m of
Reshape(x, [M, K]) times W plus b is row m of the output, and the outer Reshape lays those rows out along
T[:-1] as long as T's last entry is N. So the result is Reshape(x, T[:-1] + [K]) @ W + b, whatever the
inner Reshape's target was (the Gemm proves it 2-D with K columns). x' is:
- x itself when x has T's rank and T[:-1] provably equals x's leading dims (then M is their product, so
  x's last dim is K): MatMul broadcasts over them. The proof is element by element, from the shape
  subgraph (Concat / Shape / Gather / Slice / Squeeze / Unsqueeze of constants and Shape(v) dims, a dim of
  v equal to x's by the inferred shapes) or from the outer Reshape's inferred shape;
- Reshape(x, T) when K == N (GPT-2's attn c_proj: x is the attention's [B, S, heads, D]): the target is
  reused, and the merge is the [B, S, hidden] Reshape the attention rules expect;
- Reshape(x, constant T[:-1] + [K]) when T is constant.
Anything else would need a new shape computation, and is refused. With allowzero=0 a 0 in T copies a dim
of the Reshape's input, which is no longer the Gemm's [M, N]: a constant 0 is refused, and a computed entry
must be one proven equal to x's dim at that position (then copying x's dim gives the same). On an empty
dim the rewrite gives the empty result MatMul gives where the original Reshape may fail.

The bias must be a [N] vector, or broadcast to one over rows (a constant [1, N], [1], [] becomes a [N]
initializer; a computed one of those shapes is added as is); a [M, 1] or [M, N] bias depends on the row
and is refused. alpha and beta must be 1 and transA 0; transB=1 needs a constant weight read by this Gemm
alone, stored transposed (a shared one would be copied, a computed one transposed on every run).

Matched nodes are left for the dead-node pass (remove_nodes=False): an inner Reshape read elsewhere stays
for its other readers. A Gemm whose output is read elsewhere is refused (it would stay, computed twice).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from .common import read_elsewhere, same_dim, static_2d

_MAX_DEPTH = 8  # shape subgraphs are a few nodes deep
_Element = int | tuple  # a shape entry: a constant, or (value, axis): dim `axis` of `value`


def _const(v: ir.Value | None) -> np.ndarray | None:
    t = ir.convenience.get_const_tensor(v) if v is not None else None
    return None if t is None else t.numpy()


def _ints(v: ir.Value | ir.Attr | None) -> list[int] | None:
    if isinstance(v, ir.Attr):
        return list(v.as_ints())
    a = _const(v)
    return None if a is None or a.ndim > 1 else [int(e) for e in np.ravel(a)]


def _elements(v: ir.Value, depth: int = 0) -> tuple[list[_Element], bool] | None:
    """The entries of a shape tensor (1-D int64, or a scalar: the flag) as far as the subgraph that computes
    it can be read; None where it cannot."""
    a = _const(v)
    if a is not None:
        return ([int(e) for e in np.ravel(a)], a.ndim == 0) if a.ndim <= 1 and a.dtype.kind in "iu" else None
    node = v.producer()
    if node is None or node.domain not in ("", "ai.onnx") or depth > _MAX_DEPTH:
        return None
    if node.op_type == "Shape":
        u = node.inputs[0]
        if u.shape is None:
            return None
        rank = u.shape.rank()
        start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", rank)
        start, end = (min(max(i + rank if i < 0 else i, 0), rank) for i in (start, end))
        return [(u, i) for i in range(start, end)], False
    if node.op_type == "Concat":
        parts = [_elements(i, depth + 1) for i in node.inputs]
        if node.attributes.get_int("axis", 0) not in (0, -1) or any(p is None or p[1] for p in parts):
            return None
        return [e for p in parts for e in p[0]], False
    if node.op_type not in ("Identity", "Cast", "Unsqueeze", "Squeeze", "Gather", "Slice") or not node.inputs:
        return None
    arg = _elements(node.inputs[0], depth + 1) if node.inputs[0] is not None else None
    if arg is None:
        return None
    if node.op_type in ("Identity", "Cast"):
        return arg if node.op_type == "Identity" or node.attributes.get_int("to") == ir.DataType.INT64 else None
    elems, scalar = arg
    axes = (node.attributes["axes"] if "axes" in node.attributes else
            node.inputs[1] if len(node.inputs) > 1 else None)
    if node.op_type == "Unsqueeze":
        return (elems, False) if scalar and _ints(axes) in ([0], [-1]) else None
    if node.op_type == "Squeeze":
        one = not scalar and len(elems) == 1
        return (elems, True) if one and (axes is None or _ints(axes) in ([0], [-1])) else None
    if node.op_type == "Gather":
        idx = _const(node.inputs[1])
        if scalar or idx is None or idx.ndim > 1 or node.attributes.get_int("axis", 0) not in (0, -1):
            return None
        n = len(elems)
        if any(not -n <= int(i) < n for i in np.ravel(idx)):
            return None
        picked = [elems[int(i)] for i in np.ravel(idx)]
        return picked, idx.ndim == 0
    if node.op_type == "Slice" and len(node.inputs) >= 3:
        starts, ends = _ints(node.inputs[1]), _ints(node.inputs[2])
        s_axes = _ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else [0]
        steps = _ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
        if scalar or starts is None or ends is None or len(starts) != 1 or s_axes not in ([0], [-1]) or steps != [1]:
            return None
        return elems[starts[0]:ends[0]], False  # python's clamping of a step-1 slice is ONNX's
    return None


def _dim(v: ir.Value, i: int):
    return v.shape[i] if v.shape is not None and 0 <= i < v.shape.rank() else None


def _equals_x_dim(e: _Element, x: ir.Value, i: int, out: ir.Value) -> bool:
    """Entry i of T is provably x's dim i (from the shape subgraph or from the Reshape's inferred shape)."""
    xd = _dim(x, i)
    if isinstance(e, int):
        proven = e > 0 and xd == e
    else:
        u, axis = e
        proven = (u is x and axis == i) or same_dim(_dim(u, axis), xd)
    return proven or same_dim(_dim(out, i), xd)


def _unique_name(graph: ir.Graph | None, base: str) -> str:
    taken = graph.initializers if graph is not None else {}
    return next(n for n in (base if i == 0 else f"{base}_{i}" for i in range(len(taken) + 1)) if n not in taken)


class GemmReshapeRule(pattern.RewriteRuleClassBase):
    """Reshape(Gemm(Reshape(x, [-1, K]), W, b), [..., N]) -> Add(MatMul(x', W), b), x' = x or x reshaped
    to [..., K] (see the module docstring for when which)"""

    def __init__(self, name: str):
        super().__init__(name, remove_nodes=False)

    def pattern(self, op, x, inner_shape, w, outer_shape):
        flat = op.Reshape(x, inner_shape, _allow_other_attributes=True, _outputs=["flat"])
        y = op.Gemm(flat, w, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["y"])
        return op.Reshape(y, outer_shape, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, x, w, outer_shape, y, out, **_):
        result = pattern.MatchResult()
        gemm = y.producer()
        attrs = gemm.attributes
        alpha, beta = attrs.get_float("alpha", 1.0), attrs.get_float("beta", 1.0)
        trans_a, trans_b = attrs.get_int("transA", 0), attrs.get_int("transB", 0)
        bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None
        if alpha != 1.0 or (bias is not None and beta != 1.0) or trans_a != 0:
            return result.fail(f"Gemm alpha={alpha}, beta={beta}, transA={trans_a}: only alpha = beta = 1, "
                               "transA = 0 is a plain x @ W + b", gemm)
        if y.is_graph_output() or any(u.node is not out.producer() for u in y.uses()):
            return result.fail("the Gemm's output is read elsewhere: the Gemm would stay and the product "
                               "be computed twice", y)
        if static_2d(w) is None:
            return result.fail(f"the weight's shape {w.shape} is not a static 2-D one", w)
        k, n = (w.shape[1], w.shape[0]) if trans_b else (w.shape[0], w.shape[1])
        if trans_b:
            if _const(w) is None:
                return result.fail("transB=1 with a computed weight: the MatMul would transpose it on every run", w)
            if read_elsewhere(w):
                return result.fail("transB=1 with a weight read elsewhere too: storing it transposed would copy it", w)

        target = _elements(outer_shape)
        if target is None or target[1]:
            return result.fail("the outer Reshape's target is computed by a subgraph this rule cannot read "
                               "(not Concat/Shape/Gather/Slice/Squeeze/Unsqueeze of constants)", outer_shape)
        t = target[0]
        if len(t) < 2 or t[-1] != n:
            return result.fail(f"the outer Reshape's target {self._show(t)} does not end in N={n}: it does not "
                               "keep the Gemm's rows, so MatMul on the unflattened input is not the same", outer_shape)
        allowzero = out.producer().attributes.get_int("allowzero", 0)
        rank = x.shape.rank() if x.shape is not None else None
        proven = [_equals_x_dim(e, x, i, out) for i, e in enumerate(t[:-1])]
        if not allowzero and any(e == 0 for e in t[:-1]):
            return result.fail(f"the outer target {self._show(t)} has a 0 with allowzero=0 (copies the dim of the "
                               "Reshape's input, which would no longer be the Gemm's [M, N])", outer_shape)

        self._form = None
        if rank == len(t) and all(p or (e == -1 and _dim(x, rank - 1) == k) for p, e in zip(proven, t[:-1])):
            self._form = "direct"
        elif not allowzero and any(not p and not isinstance(e, int) for p, e in zip(proven, t[:-1])):
            return result.fail(f"the outer target {self._show(t)} has computed entries not proven equal to the "
                               f"input's dims {x.shape}: with allowzero=0 a 0 among them would copy another dim",
                               outer_shape)
        elif k == n:
            self._form = "reuse"
        elif all(isinstance(e, int) for e in t):
            self._form = "constant"
            self._target = [*t[:-1], k]
        else:
            lead = self._show(t[:-1])[1:-1]
            return result.fail(f"the input {x.shape} is not provably [{lead}, K] and K={k} != N={n}: its reshape "
                               "to [..., K] would need a new shape computation", outer_shape)

        bias_ok = self._bias(result, bias, n, x)
        if not bias_ok:
            return bias_ok
        self._trans_b, self._k, self._n, self._allowzero = bool(trans_b), k, n, allowzero
        return result

    def _bias(self, result, bias: ir.Value | None, n: int, x: ir.Value):
        """Keeps in self._bias_plan how the bias is added: None (absent), ("value", v) or ("array", [N] array)."""
        self._bias_plan = None
        if bias is None:
            return result
        if bias.dtype is not None and x.dtype is not None and bias.dtype != x.dtype:
            return result.fail(f"the bias is {bias.dtype}, the input {x.dtype}", bias)
        dims = list(bias.shape) if bias.shape is not None else None
        if dims not in ([], [1], [1, 1], [n], [1, n]):
            return result.fail(f"the bias has shape {bias.shape}: only a [N]={[n]} vector or a broadcast of one "
                               "over rows ([1, N], [1], []) is the same added to every row", bias)
        value = _const(bias)
        if dims == [n] or value is None:
            self._bias_plan = ("value", bias, None)
        else:
            self._bias_plan = ("array", np.ascontiguousarray(np.broadcast_to(value.reshape(-1), (n,))), bias.name)
        return result

    @staticmethod
    def _show(t: list[_Element]) -> str:
        return "[" + ", ".join(str(e) if isinstance(e, int) else f"{e[0].name}[{e[1]}]" for e in t) + "]"

    def rewrite(self, op, x, w, outer_shape, out, **_):
        graph = x.graph or w.graph
        if self._trans_b:
            wt = np.ascontiguousarray(_const(w).T)
            w = op.initializer(ir.tensor(wt, name=_unique_name(graph, f"{w.name}__ot_transposed")))
        src = x
        if self._form != "direct":
            if self._form == "reuse":
                shape = outer_shape
            else:
                target = np.array(self._target, dtype=np.int64)
                shape = op.initializer(ir.tensor(target, name=_unique_name(graph, f"{out.name}__ot_shape")))
            src = op.Reshape(x, shape, **({"allowzero": 1} if self._allowzero else {}))
            src.dtype = x.dtype
            if out.shape is not None:
                src.shape = ir.Shape([*list(out.shape)[:-1], self._k])
        product = op.MatMul(src, w)
        # the later rules read shapes: the product has the Reshape's (a row bias does not broadcast it)
        product.dtype = x.dtype
        if out.shape is not None:
            product.shape = ir.Shape(list(out.shape))
        elif self._form == "direct" and x.shape is not None:
            product.shape = ir.Shape([*list(x.shape)[:-1], self._n])
        if self._bias_plan is None:
            return product
        kind, bias, name = self._bias_plan
        if kind == "array":  # the [N] vector the bias rules fold
            bias = op.initializer(ir.tensor(bias, name=_unique_name(graph, f"{name}__ot_row")))
        return op.Add(product, bias)
