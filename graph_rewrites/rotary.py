"""Rotary position embedding -> Rotary (contract: ort_triton/ops/rotary.py).

Three rules:
- rotary (stage 1): HF's decomposed form, which both torch exporters emit below opset 23 (and dynamo at
  24): x * cos + Concat(Neg(x[..., h:]), x[..., :h]) * sin on x [B, N, S, D] with 2h = D, cos and sin
  broadcasting as [B or 1, 1, S, D] (HF's Unsqueeze(cos, 1); how cos is computed is not matched);
- rotary_partial (stage 2): Concat(Rotary(x[..., :R]), x[..., R:]) -> Rotary(x, rotary_dim=R), the partial
  rotary of GPT-NeoX and Phi (HF slices x_rot / x_pass around the same rotate_half);
- rotary_onnx (stage 1): ONNX RotaryEmbedding (opset 23, torch's exporter at opset_version=23) on 4-D
  [B, N, S, D] input without position_ids: its cos/sin caches [B, S, R/2] go in as they are (the op
  reads W = R/2 as one value per pair, which is the ONNX definition).

Slice bounds are read as constants or, where torchscript computes them from the shape (Shape -> Gather ->
Div -> Cast -> Unsqueeze of a static D), evaluated over the static dims (_ints).

What is not proven: where shape inference names the sequence or batch dim of cos differently from x's
(torchscript gives cos fresh symbols), the rule cannot prove they are equal. The original's broadcasting
then still means cos's dim is x's or 1, unless x's is 1 and cos's is not, which no HF model does
(cos is computed for x's positions); the native planner checks the shapes at run time and fails with a
message rather than compute something else. A static dim that differs is refused here.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from ort_triton.contract import DOMAIN
from ort_triton.ops.rotary import MAX_HEAD_DIM, ROTARY, TRANSPOSE_ROTARY

from .common import FLOAT_TYPES

_INT_TYPES = {ir.DataType.INT64, ir.DataType.INT32, ir.DataType.INT16, ir.DataType.INT8, ir.DataType.UINT8,
              ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64}
_KEEP_VALUES = ("Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten")  # reshape, same values in order


def _int_div(u: int, v: int) -> int | None:
    """Integer Div as ORT computes it (C++: truncated toward zero)."""
    if v == 0:
        return None
    q = abs(u) // abs(v)
    return q if (u >= 0) == (v > 0) else -q


def _ints(value: ir.Value | None, depth: int = 16) -> list[int | None] | None:
    """The int values of a small index tensor, flattened: from a constant, or evaluated through the shape
    arithmetic exporters write (Shape, Gather, Concat, Cast, Add/Sub/Mul/Div, reshapes); None for an
    element taken from a dynamic dim. None when the value is not such a computation."""
    if value is None or depth == 0:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        array = tensor.numpy()
        return [int(v) for v in array.reshape(-1)] if array.dtype.kind in "iu" else None
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    inputs, attrs = node.inputs, node.attributes
    if node.op_type == "Shape" and inputs[0] is not None and inputs[0].shape is not None:
        dims = list(inputs[0].shape)[attrs.get_int("start", 0):attrs.get_int("end", None)]
        return [d if isinstance(d, int) else None for d in dims]
    if node.op_type in _KEEP_VALUES or (node.op_type == "Cast" and attrs.get_int("to", 0) in _INT_TYPES):
        return _ints(inputs[0], depth - 1)
    if node.op_type == "Gather" and attrs.get_int("axis", 0) == 0:
        data, index = _ints(inputs[0], depth - 1), _ints(inputs[1], depth - 1)
        if data is None or index is None or any(i is None or not -len(data) <= i < len(data) for i in index):
            return None
        return [data[i] for i in index]
    if node.op_type == "Concat":
        parts = [_ints(i, depth - 1) for i in inputs]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]
    if node.op_type in ("Add", "Sub", "Mul", "Div") and len(inputs) == 2:
        a, b = _ints(inputs[0], depth - 1), _ints(inputs[1], depth - 1)
        if a is None or b is None or (len(a) != len(b) and 1 not in (len(a), len(b))):
            return None
        n = max(len(a), len(b))
        a, b = a * n if len(a) == 1 else a, b * n if len(b) == 1 else b
        f = {"Add": lambda u, v: u + v, "Sub": lambda u, v: u - v, "Mul": lambda u, v: u * v,
             "Div": _int_div}[node.op_type]
        return [None if u is None or v is None else f(u, v) for u, v in zip(a, b)]
    return None


def _width(x: ir.Value) -> int | None:
    """D, x's static last dim."""
    if x.shape is None or x.shape.rank() < 1 or not isinstance(x.shape[-1], int):
        return None
    return x.shape[-1]


def _slice_range(sliced: ir.Value, d: int) -> tuple[int, int] | str:
    """[start, end) that Slice takes of its input's last axis (of width d), clamped as Slice does; or
    why it is not a provable unit-step slice of the last axis only."""
    node = sliced.producer()
    data, starts, ends, axes, steps = (list(node.inputs) + [None] * 5)[:5]
    rank = data.shape.rank() if data.shape is not None else None
    s, e, a, st = _ints(starts), _ints(ends), _ints(axes) if axes is not None else None, _ints(steps)
    if s is None or e is None or len(s) != 1 or len(e) != 1 or s[0] is None or e[0] is None:
        return f"the bounds of Slice {node.name} are not constant (or computed from static dims)"
    if axes is None or a is None or len(a) != 1 or a[0] is None or a[0] not in (-1, rank and rank - 1):
        return f"Slice {node.name} does not provably slice the last axis only (axes {a})"
    if steps is not None and st != [1]:
        return f"Slice {node.name} has steps {st}, not 1"
    clamp = lambda v: min(max(v + d if v < 0 else v, 0), d)
    return clamp(s[0]), clamp(e[0])


def _dims_fit(cos: ir.Value, x: ir.Value) -> str | None:
    """Why cos's batch (dim 0) or sequence (dim -2) is provably neither x's nor 1, if it is (unknown dims
    pass: see the module docstring)."""
    for axis, x_axis, what in ((0, 0, "batch"), (-2, 2, "sequence")):
        c, xd = cos.shape[axis], x.shape[x_axis]
        if isinstance(c, int) and c != 1 and c != xd:
            return f"{cos.name} {cos.shape} has {what} dim {c}, which is neither 1 nor x's ({xd})"
    return None


def _check_cos_sin(result, x: ir.Value, cos: ir.Value, sin: ir.Value, width: int, *, heads_first: bool):
    """cos and sin of x's type, [B' or 1, 1, S' , width] (heads_first: the decomposed form, where cos
    broadcasts against [B, N, S, D], so a rank-3 cos must be [1, S', W]) or [B', S', width] (ONNX
    RotaryEmbedding's caches). Returns result, failed or not."""
    for t in (cos, sin):
        if t.dtype != x.dtype:
            return result.fail(f"{t.name} is {t.dtype}, x is {x.dtype}", t)
        shape = t.shape
        if shape is None:
            return result.fail(f"{t.name} has no known shape", t)
        if heads_first:  # [B', 1, S', W], or [1, S', W] (which broadcasts as [1, 1, S', W])
            fits = (shape.rank() == 4 and shape[1] == 1) or (shape.rank() == 3 and shape[0] == 1)
        else:  # [B', S', W]: RotaryEmbedding puts the heads after S
            fits = shape.rank() == 3
        if not fits:
            want = "[B or 1, 1, S, R] (or [1, S, R])" if heads_first else "[B, S, R/2]"
            return result.fail(f"{t.name} has shape {shape}; it must broadcast against x {x.shape} as {want}", t)
        if shape[-1] != width:
            return result.fail(f"{t.name} has last dim {shape[-1]}, not {width}", t)
        if (why := _dims_fit(t, x)) is not None:
            return result.fail(why, t)
    return result


def _check_x(result, x: ir.Value):
    """x [B, N, S, D] of a kernel type with a static D <= MAX_HEAD_DIM: D, or a failed MatchResult."""
    if x.dtype not in FLOAT_TYPES:
        return result.fail(f"element type {x.dtype} is not one of float, float16, bfloat16", x)
    if x.shape is None or x.shape.rank() != 4:
        return result.fail(f"x {x.name} has shape {x.shape}, not [B, N, S, D]", x)
    d = _width(x)
    if d is None:
        return result.fail(f"the head dim of x {x.name} is not static (shape {x.shape})", x)
    if d > MAX_HEAD_DIM:
        return result.fail(f"head dim {d} > {MAX_HEAD_DIM} (the kernel's)", x)
    return d


def _escaping(context) -> ir.Value | None:
    """A value computed inside the match (not its root) that something outside reads, if any."""
    inside = set(context.nodes)
    for node in context.nodes:
        if node is context.root:
            continue
        for v in node.outputs:
            if v.is_graph_output() or any(u.node not in inside for u in v.uses()):
                return v
    return None


class RotaryRule(pattern.RewriteRuleClassBase):
    """x * cos + Concat(Neg(x[..., h:]), x[..., :h]) * sin, 2h = D, any operand order -> Rotary(x, cos, sin)

    The matched nodes are left for the dead-node pass at the end of the stage (remove_nodes=False, with
    the check that nothing outside reads them done here): torchscript's Shape -> Gather -> Div chains
    computing the Slice bounds die with them then, and a partial rotary's x[..., :R] is left with the op
    as its only reader, which rotary_partial (stage 2) needs."""

    def __init__(self, name: str):
        super().__init__(name, remove_nodes=False)

    def pattern(self, op, x, cos, sin):
        x1 = op.Slice(x, _allow_other_inputs=True, _outputs=["x1"])
        x2 = op.Slice(x, _allow_other_inputs=True, _outputs=["x2"])
        rot = op.Concat(op.Neg(x2), x1, _allow_other_attributes=True, _outputs=["rot"])
        return op.Add(op.Mul(x, cos), op.Mul(rot, sin))

    def check(self, context, x, cos, sin, x1, x2, rot, **_):
        result = pattern.MatchResult()
        if (leak := _escaping(context)) is not None:
            return result.fail(f"{leak.name}, computed inside the rotary, is also used outside it", leak)
        d = _check_x(result, x)
        if not isinstance(d, int):
            return d
        if rot.producer().attributes.get_int("axis", 0) not in (-1, 3):
            return result.fail("the Concat of rotate_half is not over the last axis", rot.producer())
        ranges = [_slice_range(v, d) for v in (x1, x2)]
        for r, v in zip(ranges, (x1, x2)):
            if isinstance(r, str):
                return result.fail(r, v.producer())
        (s1, e1), (s2, e2) = ranges
        if s1 != 0 or s2 != e1 or e2 != d:
            return result.fail(f"the Slices take x[..., {s1}:{e1}] and x[..., {s2}:{e2}] of D={d}: not the two "
                               "halves, rotate_half(x) = cat(-x2, x1)", x1.producer())
        if 2 * e1 != d:
            return result.fail(f"rotate_half splits D={d} at {e1}, not in the middle (odd D?)", x1.producer())
        result = _check_cos_sin(result, x, cos, sin, d, heads_first=True)
        self._rotary_dim = d
        return result

    def rewrite(self, op, x, cos, sin, **_):
        return ROTARY.node(op, x, cos, sin, interleaved=0, rotary_dim=self._rotary_dim)


class PartialRotaryRule(pattern.RewriteRuleClassBase):
    """Concat(Rotary(x[..., :R], cos, sin), x[..., R:]) -> Rotary(x, cos, sin, rotary_dim=R)"""

    def pattern(self, op, x, cos, sin):
        inner = op.Rotary(op.Slice(x, _allow_other_inputs=True, _outputs=["x_rot"]), cos, sin, _domain=DOMAIN,
                          _allow_other_attributes=True, _outputs=["rotated"])
        x_pass = op.Slice(x, _allow_other_inputs=True, _outputs=["x_pass"])
        return op.Concat(inner, x_pass, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, x, x_rot, x_pass, rotated, out, **_):
        result = pattern.MatchResult()
        d = _check_x(result, x)
        if not isinstance(d, int):
            return d
        if out.producer().attributes.get_int("axis", 0) not in (-1, 3):
            return result.fail("the Concat is not over the last axis", out.producer())
        attrs = rotated.producer().attributes
        r_inner = attrs.get_int("rotary_dim", 0)
        ranges = [_slice_range(v, d) for v in (x_rot, x_pass)]
        for rng, v in zip(ranges, (x_rot, x_pass)):
            if isinstance(rng, str):
                return result.fail(rng, v.producer())
        (s1, e1), (s2, e2) = ranges
        if s1 != 0 or s2 != e1 or e2 != d or e1 != r_inner:
            return result.fail(f"x[..., {s1}:{e1}] rotated by {r_inner} channels and x[..., {s2}:{e2}] passed, of "
                               f"D={d}: not a partial rotary", x_rot.producer())
        self._plan = (attrs.get_int("interleaved", 0), r_inner)
        return result

    def rewrite(self, op, x, cos, sin, **_):
        interleaved, r = self._plan
        return ROTARY.node(op, x, cos, sin, interleaved=interleaved, rotary_dim=r)


class OnnxRotaryRule(pattern.RewriteRuleClassBase):
    """RotaryEmbedding(x [B, N, S, D], cos, sin [B, S, R/2]) (opset 23), no position_ids -> Rotary"""

    def pattern(self, op, x, cos, sin):
        return op.RotaryEmbedding(x, cos, sin, _allow_other_inputs=True, _allow_other_attributes=True,
                                  _outputs=["y"])

    def check(self, context, x, cos, sin, y, **_):
        result = pattern.MatchResult()
        node = y.producer()
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            return result.fail("position_ids is given: the op takes cos/sin per position (a Gather in front "
                               "is not done)", node)
        if x.shape is not None and x.shape.rank() == 3:
            return result.fail("x is 3-D [B, S, hidden]; the op takes heads [B, N, S, D]", x)
        d = _check_x(result, x)
        if not isinstance(d, int):
            return d
        interleaved = node.attributes.get_int("interleaved", 0)
        if interleaved not in (0, 1):
            return result.fail(f"interleaved={interleaved}", node)
        r = node.attributes.get_int("rotary_embedding_dim", 0) or d
        if r % 2 or not 2 <= r <= d:
            return result.fail(f"rotary_embedding_dim {r} is odd or not in 2..D={d}", node)
        result = _check_cos_sin(result, x, cos, sin, r // 2, heads_first=False)
        self._plan = (interleaved, r)
        return result

    def rewrite(self, op, x, cos, sin, **_):
        interleaved, r = self._plan
        return ROTARY.node(op, x, cos, sin, interleaved=interleaved, rotary_dim=r)


class TransposeRotaryRule(pattern.RewriteRuleClassBase):
    """Rotary(Transpose(x [B, S, N, D], perm=[0, 2, 1, 3]), cos, sin) -> TransposeRotary(x, cos, sin): the kernel
    reads Q or K as its projection's Reshape left them, and the Transpose's launch and copy go."""

    def pattern(self, op, x, cos, sin):
        return op.Rotary(op.Transpose(x, _allow_other_attributes=True, _outputs=["xt"]), cos, sin, _domain=DOMAIN,
                         _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, xt, y, **_):
        # a transposed x read elsewhere (or a graph output) is refused by the matcher itself ("an output of a
        # matched node is also used outside the fused region")
        result = pattern.MatchResult()
        perm = list(xt.producer().attributes.get_ints("perm", []))
        if perm != [0, 2, 1, 3]:
            return result.fail(f"the Transpose's perm is {perm}, not [0, 2, 1, 3] (the head transpose)", xt.producer())
        attrs = y.producer().attributes
        self._plan = (attrs.get_int("interleaved", 0), attrs.get_int("rotary_dim", 0))
        return result

    def rewrite(self, op, x, cos, sin, **_):
        interleaved, r = self._plan
        return TRANSPOSE_ROTARY.node(op, x, cos, sin, interleaved=interleaved, rotary_dim=r)
