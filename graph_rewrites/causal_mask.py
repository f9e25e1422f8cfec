"""Prove that a decoder's attention mask is exactly causal-with-offset and key padding, by evaluating it; and
the symbolic shapes that link the mask's sizes to the attention's.

transformers 5 builds the [B, 1, S, T] mask of a decoder from aranges over the cache positions, comparisons,
the 2-D attention_mask, And/Where and an Expand, differently per exporter (Range/LessOrEqual/GatherND from
dynamo; Cast/Reshape/Expand from torchscript). As graph_rewrites/mask.py does for encoder padding masks,
the mask is not read but run, on ORT CPU, at a few sizes:

1. slice: the nodes the mask depends on; the values of at most one 2-D graph input may flow into it (the
   attention mask), other inputs only through Shape/Size (mask.py's `_slice`);
2. sizes: the attention's query length S is Q's dim 2 and its key length T is K's dim 2, as symbolic
   expressions of the model's input dims (`SymbolicShapes`: ORT's symbolic shape inference, which keeps
   "seq" and "past + seq" where onnx's inference loses them to broadcasts). Batch, S and the past length
   T - S must each be one input dim (or static); the mask's inputs are then fed at sampled (B, S, P), the
   2-D source as [B, T], every other dim of theirs being one of those;
3. compare, at each size, with   allowed[b, i, j] = (j <= T - S + i) and attention_mask[b, j] != 0:
   a boolean mask must equal it, an additive one be 0 where allowed and one fill <= -1e4 elsewhere. The
   masks are random 0/1 with an unpadded row, a fully padded one, and a left-padded one whose first
   queries see no key, at several (B, S, P) including a prefill (P = 0) and a decode step (S = 1).

4. long: a mask that agrees at those sizes may still drop keys only far from the query (a sliding window or
   chunked attention wider than 16 keys). So it is also run for one decode step over caches of T = 32, 64,
   ... keys, where such a window drops keys of the last query once T passes it; up to 2^20 keys, or until
   one evaluation takes over _LONG_SECONDS (torchscript's masks are [T, T] before they are sliced: the
   next, 4x larger, is the last), or until the mask no longer evaluates (a position table caps the model,
   which cannot run past what its mask can be computed at).

A mask that reads no input's values (no attention_mask input) is proven the same way to be causal alone.
Limits (as mask.py's): 0/1 attention masks; sizes up to 4 x 16 and one long decode step; the source's length
is taken to be T (the planner checks key_bias [B, T] at run time, so an attention_mask of another length is an
error there, not a different result).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx
import onnx.inliner
import onnx_ir as ir
from onnx import helper

from ort_triton.contract import DOMAIN
from ort_triton.ops import BY_NAME as OPS

from .mask import DROPS, mask_session

# (B, S, P): a prefill, a decode step, S != P, a long past; each batch has a fully padded row
_SIZES = ((3, 5, 3), (3, 4, 0), (4, 1, 6), (2, 7, 9))
# key lengths T of the long decode steps, in order; and the evaluation time after which no longer one is run
_LONG = tuple(1 << k for k in range(5, 21))
_LONG_SECONDS = 0.25
_LONG_BYTES = 1 << 30  # and the feeds' size (a cache input the mask reads the shape of is zeros: not touched)
_SMALL_CONSTANT = 4096  # elements: initializers up to this stay constants for shape inference
_FUNCTIONS = {"Max", "Min", "floor", "ceiling", "Mod", "Abs", "Piecewise", "sqrt"}  # sympy names in dims


@dataclasses.dataclass(frozen=True)
class CausalPadding:
    """A proven causal-with-offset mask with key padding from `source` (an input name; None: causal only)."""

    source: str | None
    fill: float | None  # additive mask: the value on dropped keys (0 on allowed ones); None: boolean


class SymbolicShapes:
    """Symbolic shapes of a model's values from ORT's SymbolicShapeInference (without its auto-merge, which
    would assume broadcast dims equal), on a copy of the main graph: large initializers become inputs (only
    their shapes matter), our ops are inlined from their function bodies. Computed once per model object."""

    def __init__(self):
        self._model = None
        self._names: dict[ir.Value, str] = {}
        self._dims: dict[str, list] | str = {}

    def dims(self, model: ir.Model, value: ir.Value) -> list | str | None:
        """[int | sympy expression | None] per axis, None where unknown; a str when inference failed."""
        if model is not self._model:
            self._model = model
            self._names, self._dims = {}, {}
            self._dims = self._infer(model)
        if isinstance(self._dims, str):
            return self._dims
        name = self._names.get(value)
        return self._dims.get(name) if name is not None else None

    def _name(self, value: ir.Value | None) -> str:
        if value is None:
            return ""
        if value not in self._names:
            self._names[value] = value.name or f"__ot_value_{len(self._names)}"
        return self._names[value]

    def _infer(self, model: ir.Model) -> dict[str, list] | str:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        # driven by hand rather than through SymbolicShapeInference.infer_shapes, which on a graph it cannot
        # finish saves it into the working directory and raises: a partial result is still sound (values it
        # did not reach have no shape, and the rules refuse them)
        try:
            proto = onnx.inliner.inline_local_functions(self._light_model(model))
            _constants_as_tensors(proto.graph)
            sym = SymbolicShapeInference(2**31 - 1, auto_merge=False, guess_output_rank=False, verbose=0)
            sym._preprocess(proto)
            while sym.run_:
                sym._infer_impl()
        except Exception as e:  # noqa: BLE001  (inference raises many types)
            return f"symbolic shape inference failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        out = {}
        for name, vi in sym.known_vi_.items():
            t = vi.type.tensor_type
            if t.HasField("shape"):
                out[name] = [d.dim_value if d.HasField("dim_value") else
                             _parse(d.dim_param) if d.HasField("dim_param") else None for d in t.shape.dim]
        return out

    def _light_model(self, model: ir.Model) -> onnx.ModelProto:
        g = model.graph
        info = lambda v: helper.make_tensor_value_info(
            self._name(v), v.dtype.value if v.dtype is not None else 0,
            None if v.shape is None else [d if isinstance(d, int) else d.value for d in v.shape])
        inputs, inits = [info(v) for v in g.inputs], []
        for v in g.initializers.values():
            if v.is_graph_input():
                continue
            t = v.const_value
            if t is not None and t.size <= _SMALL_CONSTANT:
                proto = ir.serde.serialize_tensor(t)
                proto.name = self._name(v)
                inits.append(proto)
            else:
                inputs.append(info(v))
        nodes, used = [], set()
        for node in g:
            if node.domain in ("", "ai.onnx") and node.op_type in _STANDINS:
                nodes += _STANDINS[node.op_type]([self._name(i) for i in node.inputs],
                                                 [self._name(o) for o in node.outputs])
                continue
            proto = ir.serde.serialize_node(node)
            del proto.input[:], proto.output[:]
            proto.input.extend(self._name(i) for i in node.inputs)
            proto.output.extend(self._name(o) for o in node.outputs)
            if node.domain == DOMAIN:
                used.add(node.op_type)
                proto.output.extend([""] * (len(OPS[node.op_type].outputs) - len(proto.output)))
            nodes.append(proto)
        opsets = dict(model.opset_imports)
        functions = [ir.serde.serialize_function(f) for f in model.functions.values()]
        functions += [OPS[name].function_proto(opsets[""]) for name in sorted(used)]
        graph = helper.make_graph(nodes, "shapes", inputs, [info(v) for v in g.outputs], initializer=inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                                 functions=functions, ir_version=max(model.ir_version, 8))


def _attention_standin(ins, outs):
    """ONNX Attention on 4-D heads, for its output's shape: Q K^T V, K and V broadcast over Q's heads."""
    kt, qk = outs[0] + "__ot_kt", outs[0] + "__ot_qk"
    return [helper.make_node("Transpose", [ins[1]], [kt], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", [ins[0], kt], [qk]), helper.make_node("MatMul", [qk, ins[2]], [outs[0]])]


# ai.onnx ops that ORT's symbolic shape inference takes for com.microsoft ones of the same name (and asserts
# on): shape-equivalent stand-ins in the copy it sees (RotaryEmbedding keeps its input's shape)
_STANDINS = {
    "Attention": _attention_standin,
    "RotaryEmbedding": lambda ins, outs: [helper.make_node("Identity", [ins[0]], [outs[0]])],
}


def _constants_as_tensors(graph: onnx.GraphProto) -> None:
    """Constant(value_float=...) and the like as Constant(value=tensor): ORT's symbolic shape inference reads
    only `value` (inlined function bodies make the others)."""
    kinds = {"value_float": (onnx.TensorProto.FLOAT, False), "value_floats": (onnx.TensorProto.FLOAT, True),
             "value_int": (onnx.TensorProto.INT64, False), "value_ints": (onnx.TensorProto.INT64, True)}
    for node in graph.node:
        if node.op_type != "Constant" or len(node.attribute) != 1 or node.attribute[0].name not in kinds:
            continue
        attr = node.attribute[0]
        dtype, is_list = kinds[attr.name]
        vals = onnx.helper.get_attribute_value(attr)
        tensor = helper.make_tensor("value", dtype, [len(vals)] if is_list else [], list(vals) if is_list else [vals])
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("value", tensor))


def _parse(text: str):
    """A dim_param as a sympy expression over symbols of those names ("past + seq")."""
    import sympy

    names = {n: sympy.Symbol(n, integer=True, nonnegative=True)
             for n in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text) if n not in _FUNCTIONS}
    try:
        return sympy.parse_expr(text, local_dict=names)
    except Exception:  # noqa: BLE001  (an opaque name: one symbol)
        return sympy.Symbol(text, integer=True, nonnegative=True)


def same(a, b) -> bool:
    """Provably equal dims (ints or sympy expressions)."""
    if a is None or b is None:
        return False
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    import sympy

    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def _symbol(dim):
    """The one symbol a dim is, or its int; None otherwise."""
    if isinstance(dim, int):
        return dim
    return dim if dim is not None and getattr(dim, "is_Symbol", False) else None


class CausalMaskProver:
    """Proves masks for given (batch, S, T) dims; one verdict per (mask, sizes)."""

    def __init__(self):
        self._verdicts: dict[tuple, CausalPadding | str] = {}

    def prove(self, model: ir.Model, mask: ir.Value, batch, s_dim, t_dim) -> CausalPadding | str:
        key = (mask.name, str(batch), str(s_dim), str(t_dim))
        if mask.name is None:
            return _prove(model, mask, batch, s_dim, t_dim)
        if key not in self._verdicts:
            self._verdicts[key] = _prove(model, mask, batch, s_dim, t_dim)
        return self._verdicts[key]


def _sizes(batch, s_dim, t_dim, samples=_SIZES) -> list[dict] | str:
    """The sampled sizes: dict(B, S, T, dims={input dim name: value}) where batch, S and P = T - S are
    each an input dim (a symbol) or static."""
    import sympy

    b_sym, s_sym = _symbol(batch), _symbol(s_dim)
    if b_sym is None or s_sym is None:
        return f"the batch ({batch}) and query length ({s_dim}) of Q are not each one input dim"
    past = sympy.simplify(sympy.sympify(t_dim) - sympy.sympify(s_dim)) if t_dim is not None else None
    p_sym = _symbol(int(past) if past is not None and past.is_Integer else past)
    if p_sym is None:
        return f"the key length ({t_dim}) is not the query length ({s_dim}) plus one input dim (the past)"
    syms = [x for x in (b_sym, s_sym, p_sym) if not isinstance(x, int)]
    if len(set(syms)) != len(syms):
        return f"the batch, query and past lengths ({batch}, {s_dim}, {t_dim}) are not independent dims"
    out, seen = [], set()
    for sample in samples:
        b, s, p = (sym if isinstance(sym, int) else value for sym, value in zip((b_sym, s_sym, p_sym), sample))
        if (b, s, p) in seen or b < 1 or s < 1 or p < 0:
            continue
        seen.add((b, s, p))
        dims = {sym.name: value for sym, value in zip((b_sym, s_sym, p_sym), (b, s, p)) if not isinstance(sym, int)}
        out.append(dict(B=b, S=s, T=s + p, dims=dims))
    return out or f"no size to evaluate the mask at (static dims {batch}, {s_dim}, {t_dim})"


def _prove(model: ir.Model, mask: ir.Value, batch, s_dim, t_dim) -> CausalPadding | str:
    sizes = _sizes(batch, s_dim, t_dim)  # cheap: before the mask's session is made
    if isinstance(sizes, str):
        return sizes
    found = mask_session(model, mask)
    if isinstance(found, str):
        return found
    part, source, session = found
    rng = np.random.default_rng(0)
    verdicts = set()
    for size in sizes:
        feeds = _feeds(rng, part.inputs, source, size)
        if isinstance(feeds, str):
            return feeds
        try:
            (value,) = session.run(None, feeds)
        except Exception as e:  # noqa: BLE001
            return f"the mask could not be evaluated on ORT CPU at B={size['B']}, S={size['S']}, T={size['T']}: " \
                   f"{str(e).splitlines()[0]}"
        keep = feeds[source.name] != 0 if source is not None else np.ones((size["B"], size["T"]), bool)
        verdict = _compare(value, keep, size["S"])
        if isinstance(verdict, str):
            return f"{verdict} (at B={size['B']}, S={size['S']}, T={size['T']})"
        verdicts.add(verdict)
    long = _long_decode(session, part, source, rng, batch, s_dim, t_dim)
    if isinstance(long, str):
        return long
    verdicts.add(long)
    verdicts.discard(("none", None))  # nothing was dropped at that size
    if len(verdicts) > 1:
        return f"the mask's fill changes with the input size ({sorted(map(str, verdicts))})"
    _, fill = verdicts.pop() if verdicts else ("bool", None)
    return CausalPadding(source.name if source is not None else None, fill)


def _long_decode(session, part, source, rng, batch, s_dim, t_dim):
    """The verdict of decode steps (S = 1 where S is not static) over the caches of _LONG, longer and longer:
    the first one that is not causal-with-offset padding, or the last one's verdict."""
    import time

    verdict = ("none", None)
    sizes = _sizes(batch, s_dim, t_dim, samples=[(2, 1, t - 1) for t in _LONG])  # one symbolic pass: sympy is slow
    if isinstance(sizes, str):
        return verdict
    for size, t in zip(sizes, _LONG):
        if size["T"] != t:
            return verdict  # static dims: the sampled sizes were all the sizes there are
        feeds = _feeds(rng, part.inputs, source, size)
        if isinstance(feeds, str):
            return feeds
        if sum(f.nbytes for f in feeds.values()) > _LONG_BYTES:
            return verdict
        t0 = time.perf_counter()
        try:
            (value,) = session.run(None, feeds)
        except Exception:  # noqa: BLE001  (past a position table: the model cannot run there either)
            return verdict
        if value.shape[-1] != t:  # a Slice of a position table clamps instead of failing
            return verdict
        keep = feeds[source.name] != 0 if source is not None else np.ones((2, t), bool)
        verdict = _compare(value, keep, size["S"])
        if isinstance(verdict, str):
            return f"{verdict} (at B=2, S={size['S']}, T={t}: a long decode step)"
        if time.perf_counter() - t0 > _LONG_SECONDS:
            return verdict
    return verdict


def _feeds(rng, inputs: dict[ir.Value, bool], source: ir.Value | None, size: dict) -> dict | str:
    """The mask's inputs at one size: the source [B, T] of random 0/1 with an unpadded row, a fully padded one
    and a left-padded one whose first queries see nothing; the others random, of the dims the size gives."""
    b, s, t = size["B"], size["S"], size["T"]
    by_name = dict(size["dims"])
    if source is not None:  # its named dims are the batch and the key length, unless named otherwise
        for dim, value in zip(source.shape, (b, t)):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                if by_name.setdefault(dim.value, value) != value:
                    return f"the attention mask {source.name} is {list(source.shape)}, not [batch, keys]"
    feeds = {}
    for v, by_value in inputs.items():
        if v.dtype is None or v.shape is None:
            return f"input {v.name} has no known type and rank"
        shape = []
        for dim in v.shape:
            if isinstance(dim, int):
                shape.append(dim)
            elif dim.value in by_name:
                shape.append(by_name[dim.value])
            else:
                return (f"the mask depends on the shape of {v.name}, whose dim {dim} is none of the attention's "
                        "batch, query, past and key lengths")
        if v is source and tuple(shape) != (b, t):
            return f"the attention mask {source.name} would be {shape}, not [B={b}, T={t}]"
        dtype = v.dtype.numpy()
        if v is source:
            keep = rng.random(shape) < 0.7
            if b > 1:
                keep[0], keep[-1] = True, False  # an unpadded row, a fully padded one
            if b > 2:
                keep[1] = np.arange(t) >= min(t - 1, t - s + 1)  # left padding: queries 0, 1 see nothing
            feeds[v.name] = keep.astype(dtype)
        elif not by_value:  # only its shape is read: zeros (untouched pages, cheap at a long cache's size)
            feeds[v.name] = np.zeros(shape, dtype)
        elif np.issubdtype(dtype, np.floating):
            feeds[v.name] = rng.normal(size=shape).astype(dtype)
        else:
            feeds[v.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def _compare(mask: np.ndarray, keep: np.ndarray, s: int):
    """If mask[b, 0, i, j] means allowed = causal(i, j) & keep[b, j] everywhere: ("bool", None) for a boolean
    mask, ("fill", value) for an additive one, ("none", None) if it dropped nothing. Else why not."""
    if mask.ndim > 4:
        return f"the mask has rank {mask.ndim}, more than [B, heads, q, k]"
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    b, t = keep.shape
    if mask.shape[0] not in (1, b) or mask.shape[1] != 1 or mask.shape[2] != s or mask.shape[3] != t:
        return f"the mask has shape {list(mask.shape)}, not [B or 1, 1, S={s}, T={t}]"
    visible = np.arange(t)[None, :] <= (t - s + np.arange(s))[:, None]
    allowed = visible[None, None] & keep[:, None, None, :]
    mask = np.broadcast_to(mask, allowed.shape)
    if mask.dtype == bool:
        if (mask == allowed).all():
            return "bool", None
        bad = mask != allowed
    else:
        bad = (mask == 0) != allowed
        if not bad.any():
            fills = np.unique(mask[~allowed])
            if len(fills) == 0:
                return "none", None
            if len(fills) > 1:
                return f"the mask drops keys with several values ({fills[:3].tolist()}...)"
            fill = float(fills[0])
            if not fill <= DROPS:
                return f"the mask adds {fill} to the keys it drops, not a large negative (<= {DROPS:g})"
            return "fill", fill
    bi, _, i, j = np.argwhere(bad)[0]
    what = "keeps" if not allowed[bi, 0, i, j] else "drops"
    why = "causally hidden" if not visible[i, j] else "padded" if not keep[bi, j] else "visible, unpadded"
    return f"the mask is not causal-with-offset padding: at batch {bi}, query {i} it {what} key {j} ({why})"
