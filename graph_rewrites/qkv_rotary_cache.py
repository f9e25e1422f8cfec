"""A decoder layer's Split of its packed Q/K/V, head Reshapes, rotaries and cache Concats -> QKVRotaryCache
(contract: ort_triton/ops/qkv_rotary_cache.py).

After pack_projections (stage 9) and transpose_rotary (10), each layer of a decoder with a KV cache reads

    q, k, v = Split(QKV [B, S, (Nq + 2 Nkv) D], [Nq D, Nkv D, Nkv D], axis=-1)
    Q             = TransposeRotary(Reshape(q) [B, S, Nq, D], cos, sin)            read by the attention
    present_key   = Concat(past_key, TransposeRotary(Reshape(k) [B, S, Nkv, D], cos, sin), axis=2)
    present_value = Concat(past_value, Transpose(Reshape(v) [B, S, Nkv, D], perm=[0, 2, 1, 3]), axis=2)

and those nine nodes become QKVRotaryCache(QKV, cos, sin, past_key, past_value) -> (Q, present_key,
present_value), the outputs keeping their names (present_* are graph outputs). Q may have any readers; every
value in between must have none but the next node of the chain.

qkv_norm_rotary_cache (it runs first; on by default since session 27's H100 A/B of Qwen3-0.6B): Qwen3 normalises
each q and k head before the rotation (q_norm, k_norm: RMSNorm over D, which the rms_norm rules have made our RMSNorm):
RMSNorm(Reshape(q), q_gamma) and RMSNorm(Reshape(k), k_gamma) sit between the Reshapes and the TransposeRotarys,
and the eleven nodes become QKVNormRotaryCache(QKV, cos, sin, past_key, past_value, q_gamma, k_gamma). Both q and
k normed, with one epsilon, gammas of QKV's type. qkv_rotary_cache refuses such a layer, naming the other rule.

Not a pattern rule: the three outputs are three pattern roots, and onnxscript's matcher finds the second and
third by trying every pair of Concats in the graph for every node it starts from (N x C^2 match attempts).
On a 16-layer tiny Llama's torchscript export (826 nodes, 82 Concats) that pattern took 7.3 s a pass, run
twice with the tracer, growing with the cube of the depth; this walk, from each Split along its outputs'
readers, takes 7 ms. The matcher would also insert the replacement after the first root (its own TODO for
multi-root patterns), and a Split whose outputs come in another order (k, q, v) would be a structural miss
with no reason shown; here it is a refusal that says so.

What is proved: QKV's last axis split in the order q | k | v, the sizes [Nq D, Nkv D, Nkv D] with Nkv and D
past_key's static dims 1 and 3 (the op reads them there at run time) and Nq what the q Reshape makes; each
Reshape keeps B and S and ends in [N, D] (torchscript's computes N as -1: its dim is then what the Split's
constant width over D leaves); q and k rotated with one cos and sin (the same values, or the same ops over
them: the opset-23 export computes Cos and Sin again for each RotaryEmbedding) and the same attributes; V
transposed to heads first; each Concat (past, new) along the sequence; one element type throughout. Nodes that
read a Split part only to compute a head Reshape's shape (GPT-2's torchscript export takes [B, S] by Shape,
Gather, Unsqueeze, Concat from each part) go with the chain; any other reader of an inner value is a refusal.

qkv_cache, the same walk for a layer without rotary (GPT-2: `enable=["qkv_cache"]`, off by default until timed
on the GPU):

    q, k, v = Split(QKV + bias, ...)         sizes as above, or equal thirds (opset 18's num_outputs: dynamo)
    Q             = Transpose(Reshape(q) [B, S, Nq, D], perm=[0, 2, 1, 3])
    present_key   = Concat(past_key, Transpose(Reshape(k) [B, S, Nkv, D]), axis=2)
    present_value = Concat(past_value, Transpose(Reshape(v) [B, S, Nkv, D]), axis=2)

becomes QKVCache(x, bias, past_key, past_value) (contract: ort_triton/ops/qkv_cache.py). k and v are told from
q by their cache Concats, and from each other by the Split's order (the op's second part is appended to its
past_key input, whatever the model calls it). The bias Add goes into the op where one operand is a constant
[W] vector of QKV's type, the other [B, S, W] (no broadcast) and nothing else reads the sum; otherwise the op
reads QKV as it is with a zero bias (graph_rewrites/common.py zero_vector).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter._context import TapeBuilder
from onnxscript.rewriter._rewrite_rule import RULE_NAME_TAG

from ort_triton.contract import DOMAIN
from ort_triton.ops.qkv_cache import QKV_CACHE
from ort_triton.ops.qkv_rotary_cache import QKV_NORM_ROTARY_CACHE, QKV_ROTARY_CACHE

from .common import FLOAT_TYPES, same_dim, zero_vector

NAME = "qkv_rotary_cache"
NORM_NAME = "qkv_norm_rotary_cache"
# ops whose two nodes over the same inputs may differ: never proof that two cos values are equal
_RANDOM = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
           "Dropout"}
_SAME_DEPTH = 8  # how far back _same follows two computations (Cos(Mul(Cast(...))) is 4)


def _std(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _ours(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain == DOMAIN


def _reader(value: ir.Value, wanted, index: int | None = 0) -> ir.Node | None:
    """value's first reader for which wanted(node) holds, reading it as input `index` (None: any); an extra
    reader is refused later, by name."""
    return next((u.node for u in value.uses() if wanted(u.node) and index in (None, u.idx)), None)


def _desc(node: ir.Node) -> str:
    return f"{node.op_type} {node.name or '<without a name>'}"


@dataclasses.dataclass
class _Path:
    """What one Split output flows through: Reshape to heads, RMSNorm over each head (Qwen3's q and k; else None),
    TransposeRotary or the head Transpose, and the cache Concat reading that (None: Q's path)."""

    part: ir.Value
    reshape: ir.Node
    norm: ir.Node | None
    head: ir.Node
    concat: ir.Node | None

    @property
    def role(self) -> str:
        return "v" if self.head.op_type == "Transpose" else "k" if self.concat is not None else "q"


def _path(part: ir.Value) -> _Path | None:
    reshape = _reader(part, lambda n: _std(n, "Reshape"))
    if reshape is None:
        return None
    head = _reader(reshape.outputs[0], lambda n: _std(n, "Transpose") or _ours(n, "TransposeRotary") or
                   _ours(n, "RMSNorm"))
    norm = head if _ours(head, "RMSNorm") else None
    if norm is not None:  # a head norm (Qwen3's q_norm, k_norm) comes before a rotary
        head = _reader(norm.outputs[0], lambda n: _ours(n, "TransposeRotary"))
    if head is None:
        return None
    # the Concat's order (past, new) is checked later, with a reason
    return _Path(part, reshape, norm, head, _reader(head.outputs[0], lambda n: _std(n, "Concat"), index=None))


def _layer(split: ir.Node) -> dict[str, _Path] | None:
    """The q, k and v paths of a Split with that structure in any order (the order is checked, with a reason);
    None for any other Split (not counted as tried: a no-cache export, a Split of something else)."""
    if not _std(split, "Split") or len(split.outputs) != 3:
        return None
    paths = [_path(v) for v in split.outputs]
    if any(p is None for p in paths):
        return None
    roles = {p.role: p for p in paths}
    if set(roles) != {"q", "k", "v"} or roles["v"].concat is None:
        return None
    return roles


def _same_attrs(a: ir.Node, b: ir.Node) -> bool:
    if set(a.attributes) != set(b.attributes):
        return False
    for name, x in a.attributes.items():
        y = b.attributes[name]
        if x.type != y.type or x.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return False
        if x.type == ir.AttributeType.TENSOR:
            if x.value.dtype != y.value.dtype or not np.array_equal(x.value.numpy(), y.value.numpy()):
                return False
        elif x.value != y.value:
            return False
    return True


def _same(a: ir.Value | None, b: ir.Value | None, depth: int = _SAME_DEPTH) -> bool:
    """a and b provably hold the same values: one value, equal constants, or outputs of two nodes of one
    deterministic standard op with equal attributes over inputs that are the same in turn."""
    if a is b:
        return True
    if a is None or b is None or depth == 0:
        return False
    ca, cb = a.const_value, b.const_value
    if ca is not None and cb is not None and not (a.is_graph_input() or b.is_graph_input()):  # not overridable
        return ca.dtype == cb.dtype and np.array_equal(ca.numpy(), cb.numpy())
    pa, pb = a.producer(), b.producer()
    if pa is None or pb is None or a.index() != b.index() or pa.op_type != pb.op_type or pa.op_type in _RANDOM:
        return False
    if pa.domain not in ("", "ai.onnx") or pb.domain not in ("", "ai.onnx") or len(pa.inputs) != len(pb.inputs):
        return False
    return _same_attrs(pa, pb) and all(_same(x, y, depth - 1) for x, y in zip(pa.inputs, pb.inputs))


def _heads(path: _Path, width: int, d: int) -> int | str:
    """The heads N of path's Reshape [B, S, width] -> [B, S, N, D], or why it is not provably that."""
    node, x, y = path.reshape, path.reshape.inputs[0], path.reshape.outputs[0]
    if x.shape is None or y.shape is None or x.shape.rank() != 3 or y.shape.rank() != 4:
        return f"{_desc(node)} maps {x.shape} to {y.shape}, not [B, S, N*D] to [B, S, N, D]"
    if not (same_dim(x.shape[0], y.shape[0]) and same_dim(x.shape[1], y.shape[1])):
        return f"{_desc(node)} maps {x.shape} to {y.shape}: B and S not provably kept"
    if y.shape[3] != d or width % d:
        return f"{_desc(node)} gives heads of {y.shape[3]} (its input {width} wide), past_key's D is {d}"
    # B, S and D kept: the element count leaves the input's width over D for N (torchscript writes it as -1)
    n = y.shape[2] if isinstance(y.shape[2], int) else width // d
    if n * d != width:
        return f"{_desc(node)} makes {n} heads of {d} from {width}"
    return n


def _split_sizes(split: ir.Node, first: ir.Value) -> list[int] | str:
    """The widths [q, k, v] the Split cuts QKV's last axis into, or why they are not provably that: a constant
    sizes input of 3, or none (opset 18's num_outputs, or the outputs' count before it: equal parts of a static
    width). first: its first output (pack_projections' packed MatMul has no inferred shape: the Split's outputs
    have one)."""
    qkv = split.inputs[0]
    rank = qkv.shape.rank() if qkv.shape is not None else first.shape.rank() if first.shape is not None else None
    if rank != 3:
        return f"{_desc(split)} splits {qkv.name} of rank {rank}, not QKV [B, S, W]"
    axis = split.attributes.get_int("axis", 0)
    if axis not in (-1, 2):
        return f"{_desc(split)} splits axis {axis}, not the last of QKV [B, S, W]"
    given = split.inputs[1] if len(split.inputs) > 1 else None
    if given is None:  # equal parts
        width = qkv.shape[2] if qkv.shape is not None else None
        if not isinstance(width, int) or width % 3:
            return f"{_desc(split)} splits {qkv.name} of width {width} in 3 equal parts: not a static multiple of 3"
        return [width // 3] * 3
    sizes = ir.convenience.get_const_tensor(given) if not given.is_graph_input() else None
    if sizes is None or sizes.numpy().shape != (3,):
        return f"the sizes of {_desc(split)} are not a constant of 3"
    return [int(s) for s in sizes.numpy()]


def _feeds_shapes_only(node: ir.Node, reshapes: list[ir.Node], seen: dict, depth: int = _SAME_DEPTH) -> bool:
    """Whether all that node computes ends in the shape input of one of `reshapes` (GPT-2's torchscript export
    takes each head Reshape's [B, S] by Shape, Gather, Unsqueeze and Concat from the part it reshapes): nodes
    that go with the fusion, collected in seen."""
    if depth == 0 or node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM:
        return False
    if id(node) in seen:
        return True
    seen[id(node)] = node
    for out in node.outputs:
        if out.is_graph_output():
            return False
        for use in out.uses():
            if not ((use.node in reshapes and use.idx == 1) or _feeds_shapes_only(use.node, reshapes, seen, depth - 1)):
                return False
    return True


def _inner(paths: dict[str, _Path], new: list[tuple[ir.Value, str]]) -> list[ir.Node] | str:
    """The intermediate values go with the nodes: nothing else may read the Split's parts (but nodes that only
    compute the head Reshapes' shapes: returned, to go too), the heads, nor `new` (what each cache Concat
    appends, with what it is). Or why not."""
    reshapes = [p.reshape for p in paths.values()]
    inner = [(p.part, f"{r}'s part of the Split", p.reshape, True) for r, p in paths.items()]
    inner += [(p.reshape.outputs[0], f"{r} in heads", p.norm or p.head, False) for r, p in paths.items()]
    inner += [(p.norm.outputs[0], f"{r} normed", p.head, False) for r, p in paths.items() if p.norm is not None]
    inner += [(value, what, p.concat, False) for (value, what), p in zip(new, (paths["k"], paths["v"]))]
    shape_nodes: dict = {}
    for value, what, reader, shapes_ok in inner:
        if value.is_graph_output():
            return f"{value.name} ({what}) is a graph output"
        others = [u.node for u in value.uses() if u.node is not reader]
        if shapes_ok:
            others = [n for n in others if not _feeds_shapes_only(n, reshapes, shape_nodes)]
        if others:
            return f"{value.name} ({what}) is also read by {', '.join(_desc(n) for n in others)}"
    return list(shape_nodes.values())


def _cache(split: ir.Node, paths: dict[str, _Path], sizes: list[int]) -> tuple | str:
    """(past_key, past_value) of the cache Concats, each (past, new) along the sequence of [B, Nkv, P, D] with
    static Nkv and D, the head Reshapes and the sizes [Nq D, Nkv D, Nkv D] consistent with them; or why not."""
    q, k, v = paths["q"], paths["k"], paths["v"]
    for p, name in ((k, "key"), (v, "value")):
        cat, new = p.concat, p.head.outputs[0]
        if len(cat.inputs) != 2:
            return f"{_desc(cat)} joins {len(cat.inputs)} values, not (past_{name}, new)"
        if cat.inputs[1] is not new:
            return f"{_desc(cat)} has the inputs (new, past), not (past_{name}, new): the op appends to the past"
    past_key, past_value = k.concat.inputs[0], v.concat.inputs[0]
    pk, pv = past_key.shape, past_value.shape
    if pk is None or pk.rank() != 4 or not isinstance(pk[1], int) or not isinstance(pk[3], int):
        return f"past_key {past_key.name} has shape {pk}: not [B, Nkv, P, D] with static Nkv and D"
    nkv, d = pk[1], pk[3]
    if pv is None or pv.rank() != 4 or pv[1] != nkv or pv[3] != d:
        return f"past_value {past_value.name} has shape {pv}, past_key {past_key.name} {pk}"
    for cat in (k.concat, v.concat):
        if cat.attributes.get_int("axis", 0) not in (2, -2):
            return f"{_desc(cat)} is along axis {cat.attributes.get_int('axis', 0)}, not the sequence (2)"
    # -- the head Reshapes and the sizes: [Nq D, Nkv D, Nkv D]
    heads = {}
    for (r, p), width in zip(paths.items(), sizes):
        n = _heads(p, width, d)
        if isinstance(n, str):
            return n
        heads[r] = n
    want = [heads["q"] * d, nkv * d, nkv * d]
    if sizes != want or heads["k"] != nkv or heads["v"] != nkv:
        return (f"the sizes of {_desc(split)} are {sizes}, not [Nq D, Nkv D, Nkv D] = {want} (Nq {heads['q']} from "
                f"{_desc(q.reshape)}, Nkv {nkv} and D {d} from past_key {past_key.name}; k and v reshaped to "
                f"{heads['k']} and {heads['v']} heads)")
    return past_key, past_value


def _head_perm(head: ir.Node) -> str | None:
    perm = list(head.attributes.get_ints("perm", []))
    if perm != [0, 2, 1, 3]:
        return f"{_desc(head)} has perm {perm}, not [0, 2, 1, 3] (the head transpose)"
    return None


def _check(split: ir.Node, paths: dict[str, _Path]) -> str | dict:
    """Why this layer stays as it is, or what the op needs: its inputs and rotary attributes, and the nodes
    that only computed the head Reshapes' shapes (they go too)."""
    q, k, v = paths["q"], paths["k"], paths["v"]
    # -- the Split: QKV's last axis, constant sizes, q | k | v
    sizes = _split_sizes(split, q.part)
    if isinstance(sizes, str):
        return sizes
    order = [{id(p.part): r for r, p in paths.items()}[id(o)] for o in split.outputs]
    if order != ["q", "k", "v"]:
        return (f"{_desc(split)} gives {', '.join(order)} in that order (by what reads them); the op reads QKV "
                "packed q | k | v")
    found = _inner_and_cache(split, paths, sizes, "the rotated k")
    if isinstance(found, str):
        return found
    shape_nodes, past_key, past_value = found
    # -- q and k rotated alike; v transposed to heads first
    for i, what in ((1, "cos"), (2, "sin")):
        if not _same(q.head.inputs[i], k.head.inputs[i]):
            return (f"{_desc(q.head)} and {_desc(k.head)} rotate with different {what} "
                    f"({q.head.inputs[i].name}, {k.head.inputs[i].name})")
    attrs = [{a: h.attributes.get_int(a, 0) for a in ("interleaved", "rotary_dim")} for h in (q.head, k.head)]
    if attrs[0] != attrs[1]:
        return f"{_desc(q.head)} has {attrs[0]}, {_desc(k.head)} {attrs[1]}"
    bad_perm = _head_perm(v.head)
    if bad_perm:
        return bad_perm
    norms = _head_norms(q, k)
    if isinstance(norms, str):
        return norms
    gammas, norm_attrs = norms
    cos, sin = q.head.inputs[1], q.head.inputs[2]
    types = {x.name: x.dtype for x in (q.part, cos, sin, past_key, past_value, *gammas)}  # q.part: QKV's type
    if len(set(types.values())) != 1 or q.part.dtype not in FLOAT_TYPES:
        return f"the element types differ or are not float, float16, bfloat16: {types}"
    return dict(inputs=(split.inputs[0], cos, sin, past_key, past_value, *gammas), attrs=attrs[0] | norm_attrs,
                dead=shape_nodes)


def _head_norms(q: _Path, k: _Path) -> str | tuple[tuple[ir.Value, ...], dict]:
    """((q_gamma, k_gamma), {"epsilon": ...}) where q and k are both RMSNorm-ed per head with one epsilon, ((), {})
    where neither is, or why the layer stays."""
    if q.norm is None and k.norm is None:
        return (), {}
    if q.norm is None or k.norm is None:
        normed, plain = (q, k) if k.norm is None else (k, q)
        return (f"only {normed.role} is RMSNorm-ed per head ({_desc(normed.norm)}), {plain.role} is not: the op "
                "norms both or neither")
    eps = [n.attributes.get_float("epsilon", 1e-6) for n in (q.norm, k.norm)]
    if eps[0] != eps[1]:
        return f"{_desc(q.norm)} has epsilon {eps[0]}, {_desc(k.norm)} {eps[1]}: the op takes one"
    return (q.norm.inputs[1], k.norm.inputs[1]), {"epsilon": eps[0]}


def _drop_dead(graph: ir.Graph, values: list[ir.Value]) -> None:
    """Remove the producers of values that nothing reads any more, and theirs in turn: the Reshapes' shape
    computations and k's own Cos and Sin (opset 23) that only the fused nodes read."""
    todo = [v for v in values if v is not None]
    while todo:
        node = todo.pop().producer()
        if node is None or node.graph is not graph:
            continue
        if any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        todo.extend(v for v in node.inputs if v is not None)
        graph.remove(node, safe=True)


def _rewrite(graph: ir.Graph, name: str, paths: dict[str, _Path], dead: list[ir.Node], make) -> None:
    """Replace the layer's nodes `dead` by the one node make(op builder) builds, tagged as rule `name`; its
    outputs take the old ones' names (graph outputs keep theirs), types and shapes."""
    q, k, v = paths["q"], paths["k"], paths["v"]
    op = TapeBuilder()
    new = make(op)
    old = (q.head.outputs[0], k.concat.outputs[0], v.concat.outputs[0])
    (fused,) = op.nodes
    fused.name = f"{old[1].name}__ot_{name}"  # present_key's name: unique
    fused.metadata_props[RULE_NAME_TAG] = name
    for init in op.initializers:  # a zero bias
        graph.register_initializer(init)
    inputs = [x for n in dead for x in n.inputs]
    ir.convenience.replace_nodes_and_values(graph, v.concat, dead, [fused], list(old), list(new))
    _drop_dead(graph, inputs)


def _inner_and_cache(split: ir.Node, paths: dict[str, _Path], sizes, k_desc: str) -> str | tuple:
    """(the head Reshapes' shape nodes that go with the chain, past_key, past_value), or why not (see _inner and
    _cache); k_desc names what k's cache Concat reads."""
    k, v = paths["k"], paths["v"]
    shape_nodes = _inner(paths, [(k.head.outputs[0], k_desc), (v.head.outputs[0], "the transposed v")])
    if isinstance(shape_nodes, str):
        return shape_nodes
    pasts = _cache(split, paths, sizes)
    return pasts if isinstance(pasts, str) else (shape_nodes, *pasts)


def _chain(split: ir.Node, paths: dict[str, _Path]) -> list[ir.Node]:
    """The layer's nodes from the Split to the cache Concats."""
    return [split, *(n for p in paths.values() for n in (p.reshape, p.norm, p.head) if n is not None),
            paths["k"].concat, paths["v"].concat]


def _fuse_all(model: ir.Model, name: str, layer, check, make) -> tuple[int, int, list[tuple[str, str]]]:
    """Every Split of the main graph that `layer` gives paths for is tried; `check` gives a reason to leave it or
    a plan, and make(op, plan) the fused node. Returns (Splits with the structure, fused, (Split, reason) for each
    left alone)."""
    graph = model.graph
    tried, fused, refused = 0, 0, []
    for split in [n for n in graph if _std(n, "Split")]:
        paths = layer(split)
        if paths is None:
            continue
        tried += 1
        plan = check(split, paths)
        if isinstance(plan, str):
            refused.append((split.name or "Split", plan))
            continue
        _rewrite(graph, name, paths, _chain(split, paths) + plan["dead"], lambda op, plan=plan: make(op, plan))
        fused += 1
    if fused:
        graph.sort()  # the op sits where V's Concat was; its inputs (cos, past) may come later in the list
    return tried, fused, refused


def _check_no_norms(split: ir.Node, paths: dict[str, _Path]) -> str | dict:
    """_check, for a layer with no head norm: QKVRotaryCache's."""
    normed = [p.norm for p in paths.values() if p.norm is not None]
    if normed:
        return (f"{' and '.join(_desc(n) for n in normed)} RMSNorm the heads before the rotary: rule {NORM_NAME} "
                f"takes such layers (off by default until timed: --enable {NORM_NAME})")
    return _check(split, paths)


def qkv_rotary_cache(model: ir.Model) -> tuple[int, int, list[tuple[str, str]]]:
    """Fuse every such layer of the main graph (see _fuse_all for what it returns)."""
    return _fuse_all(model, NAME, _layer, _check_no_norms, lambda op, plan: QKV_ROTARY_CACHE.node(
        op, *plan["inputs"], outputs=[True] * 3, **plan["attrs"]))


def _normed_layer(split: ir.Node) -> dict[str, _Path] | None:
    """_layer's paths where q or k is RMSNorm-ed per head; None for any other Split."""
    paths = _layer(split)
    return paths if paths is not None and (paths["q"].norm or paths["k"].norm) else None


def qkv_norm_rotary_cache(model: ir.Model) -> tuple[int, int, list[tuple[str, str]]]:
    """Fuse every layer whose q and k are RMSNorm-ed per head (Qwen3) into QKVNormRotaryCache (see _fuse_all)."""
    return _fuse_all(model, NORM_NAME, _normed_layer, _check, lambda op, plan: QKV_NORM_ROTARY_CACHE.node(
        op, *plan["inputs"], outputs=[True] * 3, **plan["attrs"]))


# ---- QKVCache: the same layer without rotary (GPT-2), the projection's bias folded in -----------------------------

PLAIN_NAME = "qkv_cache"


def _plain_layer(split: ir.Node) -> dict[str, _Path] | None:
    """The q, k and v paths of a Split whose three parts are each reshaped to heads and transposed (no rotary),
    two of them then appended to a cache by a Concat: by the Split's order, checked with a reason. None for any
    other Split (not counted as tried: a no-cache export, QKVRotaryCache's layers, a Split of something else)."""
    if not _std(split, "Split") or len(split.outputs) != 3:
        return None
    paths = [_path(v) for v in split.outputs]
    if any(p is None or p.head.op_type != "Transpose" for p in paths):
        return None
    if sum(p.concat is not None for p in paths) != 2:
        return None
    return dict(zip("qkv", paths))


def _bias(qkv: ir.Value, width: int) -> tuple[ir.Value, ir.Value | None]:
    """(x, bias) where QKV = Add(x, bias) with bias a constant [width] of QKV's type and nothing else reading
    the sum: the Add goes into the op. Else (QKV, None): the op reads QKV as it is, with a zero bias."""
    add = qkv.producer()
    if not _std(add, "Add") or len(add.inputs) != 2 or qkv.is_graph_output() or len(qkv.uses()) != 1:
        return qkv, None
    for x, b in (add.inputs, reversed(add.inputs)):
        if b is None or x is None or b.is_graph_input():
            continue
        const = ir.convenience.get_const_tensor(b)
        if const is None or const.numpy().shape != (width,) or b.dtype != qkv.dtype or x.dtype != qkv.dtype:
            continue
        if x.shape is not None and x.shape.rank() == 3 and x.shape[2] == width:  # no broadcast in the Add
            return x, b
    return qkv, None


def _check_plain(split: ir.Node, paths: dict[str, _Path]) -> str | dict:
    """Why this layer stays as it is, or what QKVCache needs: its inputs, and the nodes that go with the chain
    (the bias Add, the head Reshapes' shape computations)."""
    q = paths["q"]
    sizes = _split_sizes(split, q.part)
    if isinstance(sizes, str):
        return sizes
    if q.concat is not None:  # the two cached parts are k and v, in the Split's order: q must come first
        roles = ", ".join("a cache Concat" if p.concat is not None else "no cache Concat" for p in paths.values())
        return (f"{_desc(split)}'s parts go to {roles} in that order; the op reads QKV packed q | k | v (q, the part "
                "not cached, first)")
    for p in paths.values():
        bad_perm = _head_perm(p.head)
        if bad_perm:
            return bad_perm
    found = _inner_and_cache(split, paths, sizes, "the transposed k")
    if isinstance(found, str):
        return found
    shape_nodes, past_key, past_value = found
    types = {x.name: x.dtype for x in (q.part, past_key, past_value)}  # q.part: QKV's type
    if len(set(types.values())) != 1 or q.part.dtype not in FLOAT_TYPES:
        return f"the element types differ or are not float, float16, bfloat16: {types}"
    x, bias = _bias(split.inputs[0], sum(sizes))
    dead = shape_nodes + ([split.inputs[0].producer()] if bias is not None else [])
    return dict(inputs=(x, bias, past_key, past_value), width=sum(sizes), dead=dead)


def _make_plain(op, plan):
    x, bias, past_key, past_value = plan["inputs"]
    bias = bias if bias is not None else zero_vector(op, x, plan["width"], "qkv_cache_bias")
    return QKV_CACHE.node(op, x, bias, past_key, past_value, outputs=[True] * 3)


def qkv_cache(model: ir.Model) -> tuple[int, int, list[tuple[str, str]]]:
    """Fuse every GPT-2-like layer (no rotary) of the main graph into QKVCache (see _fuse_all for what it
    returns)."""
    return _fuse_all(model, PLAIN_NAME, _plain_layer, _check_plain, _make_plain)
