"""Self-attention -> MultiHeadAttention (contract: ort_triton/ops/attention.py).

Three forms, one rule each, all rooted where the heads are merged back to [B, S, hidden]:
- decomposed: Reshape(Transpose(MatMul(softmax(Q K^T * s + mask), V))) with the heads split by
  Reshape [B, S, N, D] + Transpose, as eager attention and sdpa below opset 23 export;
- ONNX Attention (opset 23) on [B, N, S, D] heads, split and merged around it (torch's sdpa at opset 23);
- ONNX Attention on 3-D [B, S, hidden] inputs with q_num_heads.

The op takes the projections before the head split and the padding mask as key_bias [B, Skv]. The mask
is proven a key-padding mask by graph_rewrites/mask.py, and key_bias is rebuilt from the 2-D attention
mask input with the fill that keeps the original's meaning on fully padded rows (the contract's two
meanings: a finite fill gives the mean of V, -inf gives 0).

Matched nodes are left for onnxscript's dead-node pass (remove_nodes=False) rather than removed at once:
the mask subgraph, the shape arithmetic of the sdpa K transpose and the guards die only once every layer
is fused, and the readers of matched values that feed only the match (a Shape) must not block it.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern

from ort_triton.contract import DOMAIN
from ort_triton.ops.attention import HEAD_DIMS, MULTI_HEAD_ATTENTION

from .common import FLOAT_TYPES, check_zero_bias_to_fold, zero_vector
from .mask import DROPS, KeyPadding, MaskProver

_HEADS = [0, 2, 1, 3]  # [B, S, N, D] <-> [B, N, S, D]
_CAPTIVE_DEPTH = 6  # how far a reader of a matched value may be from the match and still die with it


def _same(a, b) -> bool:
    """Provably equal dims: equal ints, or one named symbol."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a is not None and b is not None and a.value is not None and a.value == b.value


def _dims(v: ir.Value | None, rank: int):
    return list(v.shape) if v is not None and v.shape is not None and v.shape.rank() == rank else None


def _head_split(x: ir.Value, split: ir.Value) -> tuple[int, int] | str:
    """(N, D) where Reshape x [B, S, N*D] -> split [B, S, N, D] is provably a head split, else why not."""
    xs, ss = _dims(x, 3), _dims(split, 4)
    if xs is None or not isinstance(xs[2], int):
        return f"{x.name} is not [B, S, hidden] with a static hidden size (shape {x.shape})"
    if ss is None or not (_same(xs[0], ss[0]) and _same(xs[1], ss[1])):
        return f"the Reshape {x.shape} -> {split.shape} is not provably a head split [B, S, N, D]"
    hidden = xs[2]
    n, d = (s if isinstance(s, int) else None for s in ss[2:])
    if n is None and d is None:
        return f"unknown head count: the Reshape to {split.shape} has neither N nor D static"
    n, d = n or hidden // d, d or hidden // n
    if n * d != hidden:
        return f"the Reshape to {split.shape} does not split hidden size {hidden} into heads"
    return n, d


def _qkv_layout(q: ir.Value, k: ir.Value, v: ir.Value) -> str | None:
    """Why Q, K, V are not provably [B, Sq, H], [B, Skv, H], [B, Skv, H], if they are not."""
    qd, kd, vd = (_dims(x, 3) for x in (q, k, v))
    if qd is None or kd is None or vd is None or not (
            _same(qd[0], kd[0]) and _same(kd[0], vd[0]) and _same(kd[1], vd[1])):
        return f"Q {q.shape}, K {k.shape}, V {v.shape} are not provably one batch, with K and V of one length"
    return None


# Inside the match, ONNX shape inference often loses the dims (it gives a fresh symbol to every broadcast
# of the scores with the mask), but they are known: scores are [B, N, Sq, Skv] with B, Sq of Q, and the
# mask cannot widen them (mask.py proves its heads axis 1, its query axis 1 or Skv = Sq), so the context
# is [B, N, Sq, D] and, transposed, [B, Sq, N, D]. A dim of a value in there is B (or Sq) if inference
# says so or if it is Q's.
def _is(dim, *known) -> bool:
    return any(_same(dim, k) for k in known)


def _merges_heads(merged: ir.Value, out: ir.Value, q: ir.Value) -> bool:
    """Reshape [B, Sq, N, D] -> [B, Sq, N*D]: rank 3 keeping B and Sq (the last dim then is N*D)."""
    ms, os_, qs = _dims(merged, 4) or [None] * 4, _dims(out, 3), list(q.shape)
    return os_ is not None and _is(os_[0], ms[0], qs[0]) and _is(os_[1], ms[1], qs[1])


def _keeps_heads(ctx: ir.Value, out: ir.Value, q: ir.Value, d: int) -> bool:
    """Reshape [B, N, Sq, D] -> [B, N, Sq, D] (torchscript's sdpa: [B, -1, Sq, D]): B, Sq and D kept."""
    cs, os_, qs = _dims(ctx, 4) or [None] * 4, _dims(out, 4), list(q.shape)
    return os_ is not None and _is(os_[0], cs[0], qs[0]) and _is(os_[2], cs[2], qs[1]) and os_[3] == d


def _scalar(v: ir.Value | None) -> float | None:
    value = _ir_utils.get_singleton_value(v) if v is not None else None
    return None if value is None else float(value)


def _score_scale(result, muls, div, nan_zero, casts, dtype):
    """The scale of the scores, Q's and K's pre-scales and the Mul after Q K^T times, divided by the Div (each a
    finite nonzero constant scalar or absent), or result's failure saying which is not; also fails where the
    Where after IsNaN(softmax) writes anything but 0, or a Cast around the softmax leaves the element type."""
    scale = 1.0
    for factor, value in [(1, m) for m in muls] + [(-1, div)]:
        if value is None:
            continue
        c = _scalar(value)
        if c is None or c == 0 or not math.isfinite(c):
            return result.fail(f"the scale {value.name} is not a finite nonzero constant scalar", value)
        scale *= c ** factor
    if nan_zero is not None and _scalar(nan_zero) != 0:
        return result.fail("the Where after IsNaN(softmax) does not write 0", nan_zero)
    for c in casts:
        if c is not None and c.producer().attributes.get_int("to") != dtype:
            return result.fail(f"the Cast after the softmax changes the element type ({dtype} to "
                               f"{ir.DataType(c.producer().attributes.get_int('to'))})", c)
    return scale


def _escaping(nodes, root: ir.Node) -> ir.Value | None:
    """A value computed inside the match that something outside still reads, if any. A reader whose own
    outputs feed only the match (the Shape computing a Reshape target) dies with it and does not count."""
    inside = set(nodes)

    def dies(node: ir.Node, depth: int) -> bool:
        if node in inside:
            return True
        return depth > 0 and all(not v.is_graph_output() and all(dies(u.node, depth - 1) for u in v.uses())
                                 for v in node.outputs)

    for node in nodes:
        if node is root:
            continue
        for v in node.outputs:
            if v.is_graph_output() or not all(dies(u.node, _CAPTIVE_DEPTH) for u in v.uses()):
                return v
    return None


def _before_projection(k: ir.Value) -> ir.Value:
    """The input of K's projection (x of x @ W + b), which has K's batch and length: the zero key bias of a
    model without a mask takes its [B, Skv] from there, not from K, so that K keeps one reader and
    attention_bias and pack_qkv can still take its projection (ViT's exports)."""
    node = k.producer()
    if node is not None and node.op_type == "Add" and len(node.inputs) == 2:
        vector = [i for i in node.inputs if i.const_value is not None and i.shape is not None and i.shape.rank() == 1]
        if len(vector) == 1:
            node = (node.inputs[1] if vector[0] is node.inputs[0] else node.inputs[0]).producer()
    if node is not None and node.op_type == "MatMul" and node.inputs[1].const_value is not None:
        x = node.inputs[0]
        if len(node.inputs[1].shape or ()) == 2 and x.shape is not None and x.shape.rank() == 3:
            return x
    return k


class _AttentionRule(pattern.RewriteRuleClassBase):
    """Shared checks and the rewrite. `check` of a subclass fills self._plan; `rewrite` emits it."""

    def __init__(self, name: str):
        super().__init__(name, remove_nodes=False)
        self._prover = MaskProver()

    def _heads(self, result, q: ir.Value, splits) -> tuple[int, int] | pattern.MatchResult:
        """(N, D) of the head splits [(projection, its Reshape to [B, S, N, D])], all alike."""
        heads = set()
        for x, split in splits:
            nd = _head_split(x, split)
            if isinstance(nd, str):
                return result.fail(nd, x)
            heads.add(nd)
        if (why := _qkv_layout(*(x for x, _ in splits))) is not None:
            return result.fail(why, q)
        return self._kernel_takes(result, q, [x for x, _ in splits], heads)

    @staticmethod
    def _kernel_takes(result, q: ir.Value, qkv, heads: set) -> tuple[int, int] | pattern.MatchResult:
        """The one (N, D) of `heads`, if the kernel takes it and the element type of Q, K and V."""
        if q.dtype not in FLOAT_TYPES:
            return result.fail(f"element type {q.dtype} is not one of float, float16, bfloat16"
                               if q.dtype else "element type of Q is unknown (run shape inference)", q)
        for x in qkv:
            if x.dtype != q.dtype:
                return result.fail(f"{x.name} is {x.dtype}, Q is {q.dtype}", x)
        if len(heads) != 1:
            return result.fail(f"Q, K and V are split into different heads (N, D) {sorted(heads)}", q)
        n, d = next(iter(heads))
        if d not in HEAD_DIMS:
            return result.fail(f"head dim {d} not in {HEAD_DIMS} (the kernel's)", q)
        return n, d

    def _no_escape(self, result, context) -> pattern.MatchResult | None:
        leak = _escaping(context.nodes, context.root)
        if leak is not None:
            return result.fail(f"{leak.name}, computed inside the attention, is also used outside it", leak)
        return None

    def _mask(self, result, context, mask: ir.Value, q: ir.Value, k: ir.Value) -> KeyPadding | pattern.MatchResult:
        proof = self._prover.prove(context.model, mask)
        if isinstance(proof, str):
            return result.fail(proof, mask)
        if proof.per_query and not _same(q.shape[1], k.shape[1]):
            return result.fail(f"the mask is [.., keys, keys] but Q {q.shape} and K {k.shape} are not provably "
                               "of one length", mask)
        return proof

    def rewrite(self, op, **_):
        q, k, v, n, hidden, scale, source, fill = self._plan
        dtype = q.dtype.numpy()
        if source is None:  # no mask: a zero bias [B, Skv] (every contract input is required)
            shape = op.Shape(_before_projection(k), start=0, end=2)
            key_bias = op.ConstantOfShape(shape, value=ir.tensor(np.zeros(1, dtype)))
        else:
            keep = op.Cast(source, to=ir.DataType.BOOL)
            key_bias = op.Where(keep, op.Constant(value=ir.tensor(np.array(0, dtype))),
                                op.Constant(value=ir.tensor(np.array(fill, dtype))))
        # K's and V's projection biases: zeros here (every contract input is required); attention_bias
        # folds the model's in
        biases = [zero_vector(op, x, hidden, "bias") for x in (k, v)]
        return MULTI_HEAD_ATTENTION.node(op, q, k, v, key_bias, *biases, num_heads=n, scale=scale)

    @staticmethod
    def _source(context, proof: KeyPadding) -> ir.Value:
        return next(i for i in context.graph_or_function.inputs if i.name == proof.source)


class DecomposedAttentionRule(_AttentionRule):
    """Reshape(Transpose(MatMul(softmax(Q K^T * s [+ mask]), V))), heads split by Reshape + Transpose
    -> MultiHeadAttention(Q, K, V, key_bias)

    K^T is Transpose(split, [0, 2, 3, 1]), a second Transpose of the heads, or (dynamo's sdpa) the heads
    flattened to [B*N, S, D], transposed and unflattened. The scale is a Mul or Div of the scores, or a
    Mul of Q and K each (sdpa's D^-1/4), or absent. The mask is added, or selects scores by Where. An
    IsNaN/Where after the softmax (sdpa's guard for fully masked rows) is part of the match.
    """

    def pattern(self, op, q, k, v, q_shape, k_shape, v_shape, flat_shape, unflat_shape, ctx_shape, merge_shape,
                q_scale, k_scale, s_mul, s_div, mask, keep, fill, nan_zero):
        def split(x, shape, name):
            return op.Reshape(x, shape, _allow_other_attributes=True, _outputs=[name])

        q4 = op.Transpose(split(q, q_shape, "q_split"), perm=_HEADS)
        k_split = split(k, k_shape, "k_split")
        k4 = op.Transpose(k_split, perm=_HEADS, _outputs=["k_heads"])
        kt = pattern.OrValue([
            op.Transpose(k_split, perm=[0, 2, 3, 1]),
            op.Transpose(k4, perm=[0, 1, 3, 2]),
            op.Reshape(op.Transpose(op.Reshape(k4, flat_shape, _allow_other_attributes=True, _outputs=["k_flat"]),
                                    perm=[0, 2, 1]),
                       unflat_shape, _allow_other_attributes=True, _outputs=["k_unflat"]),
        ])
        # Mul and Add in either operand order (exporters write Add(mask, scores) as often as the other), as
        # alternatives here rather than the registry's commute, which would copy the whole pattern per node
        qk = op.MatMul(pattern.OrValue([op.Mul(q4, q_scale), op.Mul(q_scale, q4), q4]),
                       pattern.OrValue([op.Mul(kt, k_scale), op.Mul(k_scale, kt), kt]))
        scores = pattern.OrValue([op.Mul(qk, s_mul), op.Mul(s_mul, qk), op.Div(qk, s_div), qk])
        logits = pattern.OrValue([op.Add(scores, mask), op.Add(mask, scores), op.Where(keep, scores, fill), scores])
        probs = op.Softmax(logits, _allow_other_attributes=True, _outputs=["probs"])
        guarded = pattern.OrValue([op.Where(op.IsNaN(probs), nan_zero, probs), probs])
        # softmax(dtype=float32).to(dtype), on a float32 model: Casts to the type it has (checked)
        cast = op.Cast(guarded, _outputs=["cast"])
        guarded = pattern.OrValue([op.Cast(cast, _outputs=["recast"]), cast, guarded])
        v4 = op.Transpose(split(v, v_shape, "v_split"), perm=_HEADS)
        ctx = op.MatMul(guarded, v4, _outputs=["ctx"])
        ctx = pattern.OrValue([op.Reshape(ctx, ctx_shape, _allow_other_attributes=True, _outputs=["ctx_kept"]), ctx])
        heads = op.Transpose(ctx, perm=_HEADS, _outputs=["merged"])
        return op.Reshape(heads, merge_shape, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, q, k, v, q_split, k_split, v_split, probs, ctx, merged, out, q_scale=None,
              k_scale=None, s_mul=None, s_div=None, mask=None, keep=None, fill=None, nan_zero=None, k_heads=None,
              k_flat=None, k_unflat=None, ctx_kept=None, cast=None, recast=None, **_):
        result = pattern.MatchResult()
        softmax = probs.producer()
        axis = softmax.attributes.get_int("axis", -1)  # the default since opset 13 (optimize takes >= 15)
        if axis not in (-1, 3):
            return result.fail(f"Softmax over axis {axis}, not the keys (-1)", softmax)
        heads = self._heads(result, q, [(q, q_split), (k, k_split), (v, v_split)])
        if not isinstance(heads, tuple):
            return heads
        n, d = heads
        if k_flat is not None and not self._flat_transpose(k_heads, k_flat, k_unflat):
            return result.fail("the K reshapes around the [0, 2, 1] Transpose are not provably a flatten of "
                               "[B, N] and its inverse", k_flat)
        if ctx_kept is not None and not _keeps_heads(ctx, ctx_kept, q, d):
            return result.fail(f"the Reshape {ctx.shape} -> {ctx_kept.shape} of the context does not provably "
                               "keep [B, N, Sq, D]", ctx_kept)
        if not _merges_heads(merged, out, q):
            return result.fail(f"the Reshape {merged.shape} -> {out.shape} does not provably merge the heads", out)
        scale = _score_scale(result, (q_scale, k_scale, s_mul), s_div, nan_zero, (cast, recast), q.dtype)
        if not isinstance(scale, float):
            return scale
        if (leak := self._no_escape(result, context)) is not None:
            return leak
        source, fill_value = None, None
        if mask is not None or keep is not None:
            proof = self._mask(result, context, mask if mask is not None else keep, q, k)
            if not isinstance(proof, KeyPadding):
                return proof
            if proof.source is not None:  # else it keeps every key: no mask
                fill_value = self._fill(result, proof, mask, fill, q.dtype, guarded=nan_zero is not None)
                if not isinstance(fill_value, float):
                    return fill_value
                source = self._source(context, proof)
        self._plan = (q, k, v, n, n * d, scale, source, fill_value)
        return result

    @staticmethod
    def _flat_transpose(k4: ir.Value, flat: ir.Value, unflat: ir.Value) -> bool:
        """[B, N, S, D] -> [B*N, S, D] -> (Transpose) [B*N, D, S] -> [B, N, D, S]: the reshapes keep the
        trailing dims (so the first flattens B, N row-major) and the second restores B, N."""
        ks, fs, us = _dims(k4, 4), _dims(flat, 3), _dims(unflat, 4)
        return (ks is not None and fs is not None and us is not None and _same(fs[1], ks[2]) and _same(fs[2], ks[3])
                and all(_same(us[i], ks[j]) for i, j in ((0, 0), (1, 1), (2, 3), (3, 2))))

    @staticmethod
    def _fill(result, proof: KeyPadding, mask, fill, dtype, *, guarded: bool) -> float | pattern.MatchResult:
        """The key_bias fill that gives the original's result, fully padded rows included."""
        if mask is not None:  # added to the scores: the same fill is the same arithmetic
            value = proof.fill
        else:  # Where(keep, scores, fill): dropped scores become `fill`, whatever the score
            value = _scalar(fill)
            if value is None or not value <= DROPS:
                return result.fail(f"the Where fill {fill.name} is not a constant <= {DROPS:g}", fill)
            if math.isfinite(value):  # a fully padded row is uniform; finfo.min swamps every score alike
                if dtype == ir.DataType.FLOAT16:  # ... in fp32 and bf16; fp16's -65504 is a shift in fp32
                    return result.fail(f"the float16 Where fill {fill.name} ({value:g}) makes a fully padded row "
                                       "the mean of V, which MultiHeadAttention cannot give in float16 (its "
                                       "finfo.min does not swamp a score in float32)", fill)
                value = float(ml_dtypes.finfo(dtype.numpy()).min)
        if value == -math.inf and not guarded:
            return result.fail("a fully padded row gives NaN here (a -inf mask and no IsNaN guard); the op "
                               "gives 0", mask if mask is not None else fill)
        return value


class _OnnxAttentionRule(_AttentionRule):
    """Shared checks of ONNX Attention (opset 23): plain multi-head self-attention only."""

    def _check_node(self, result, context, node: ir.Node, q: ir.Value, k: ir.Value,
                    d: int) -> tuple[float, ir.Value | None, float] | pattern.MatchResult:
        """(scale, mask source, key_bias fill), or a failed MatchResult."""
        attrs = node.attributes
        if attrs.get_int("is_causal", 0):
            return result.fail("is_causal=1 (a causal mask is not key padding)", node)
        if attrs.get_float("softcap", 0.0):
            return result.fail("softcap is set", node)
        if any(i is not None for i in node.inputs[4:]):
            return result.fail("past key/value or nonpad_kv_seqlen inputs (a KV cache) are not fused", node)
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return result.fail("present key/value or qk_matmul_output are read", node)
        if (leak := self._no_escape(result, context)) is not None:
            return leak
        scale = attrs.get_float("scale", 1 / math.sqrt(d))
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        if mask is None:
            return scale, None, 0.0
        proof = self._mask(result, context, mask, q, k)
        if not isinstance(proof, KeyPadding):
            return proof
        if proof.source is None:  # it keeps every key: no mask
            return scale, None, 0.0
        if proof.fill is not None and proof.fill != -math.inf:
            # a boolean mask or -inf gives 0 on a fully masked row, like the op with -inf; a finite fill
            # does not: the spec averages V there, ORT CPU gives 0 for finfo.min
            return result.fail(f"an additive mask with the finite fill {proof.fill:g}: fully masked rows are "
                               "defined differently by the ONNX spec and ORT", mask)
        return scale, self._source(context, proof), -math.inf


class OnnxAttentionRule(_OnnxAttentionRule):
    """Reshape(Transpose(Attention(Q4, K4, V4, mask?))) with every [B, N, S, D] input a head split of a
    [B, S, hidden] projection -> MultiHeadAttention(Q, K, V, key_bias)"""

    def pattern(self, op, q, k, v, q_shape, k_shape, v_shape, merge_shape):
        def heads(x, shape, name):
            return op.Transpose(op.Reshape(x, shape, _allow_other_attributes=True, _outputs=[name]), perm=_HEADS)

        y = op.Attention(heads(q, q_shape, "q_split"), heads(k, k_shape, "k_split"), heads(v, v_shape, "v_split"),
                         _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["y"])
        merged = op.Transpose(y, perm=_HEADS, _outputs=["merged"])
        return op.Reshape(merged, merge_shape, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, q, k, v, q_split, k_split, v_split, y, merged, out, **_):
        result = pattern.MatchResult()
        heads = self._heads(result, q, [(q, q_split), (k, k_split), (v, v_split)])
        if not isinstance(heads, tuple):
            return heads
        if not _merges_heads(merged, out, q):
            return result.fail(f"the Reshape {merged.shape} -> {out.shape} does not provably merge the heads", out)
        checked = self._check_node(result, context, y.producer(), q, k, heads[1])
        if not isinstance(checked, tuple):
            return checked
        self._plan = (q, k, v, heads[0], heads[0] * heads[1], *checked)
        return result


class OnnxAttention3dRule(_OnnxAttentionRule):
    """Attention(Q, K, V, mask?; q_num_heads = kv_num_heads = N) on [B, S, hidden] -> MultiHeadAttention"""

    def pattern(self, op, q, k, v, q_heads):
        # q_num_heads is required by the pattern: Attention on 4-D heads has none, and is not tried here
        return op.Attention(q, k, v, q_num_heads=q_heads, _allow_other_inputs=True, _allow_other_attributes=True,
                            _outputs=["y"])

    def check(self, context, q, k, v, y, q_heads, **_):
        result = pattern.MatchResult()
        node = y.producer()
        n = q_heads.as_int()
        if node.attributes.get_int("kv_num_heads", n) != n:
            return result.fail(f"kv_num_heads differs from q_num_heads={n} (grouped-query attention)", node)
        if (why := _qkv_layout(q, k, v)) is not None:
            return result.fail(why, q)
        hidden = {x.shape[2] for x in (q, k, v)}
        if len(hidden) != 1 or not isinstance(h := next(iter(hidden)), int) or h % n:
            return result.fail(f"Q, K and V do not have one static hidden size that {n} heads divide "
                               f"({q.shape}, {k.shape}, {v.shape})", q)
        heads = self._kernel_takes(result, q, (q, k, v), {(n, h // n)})
        if not isinstance(heads, tuple):
            return heads
        checked = self._check_node(result, context, node, q, k, heads[1])
        if not isinstance(checked, tuple):
            return checked
        self._plan = (q, k, v, heads[0], heads[0] * heads[1], *checked)
        return result


class AttentionBiasRule(pattern.RewriteRuleClassBase):
    """ot.MultiHeadAttention(q, mk + ck, mv + cv, kb, 0, 0) -> ot.MultiHeadAttention(q, mk, mv, kb, ck, cv):
    the K and V projections' bias Adds go into the op (each c the [N*D] bias of its MatMul; Q's stays, see
    ort_triton/ops/attention.py). fold="kv" takes both; "k" or "v" one of them, where the other projection
    has no bias or its Add cannot go (a later stage, so that a pair is always folded at once)."""

    def __init__(self, name: str, fold: str = "kv"):
        super().__init__(name)
        self._fold = fold

    def pattern(self, op, q, mk, ck, mv, cv, key_bias, zk, zv):
        k = op.Add(mk, ck) if "k" in self._fold else mk
        v = op.Add(mv, cv) if "v" in self._fold else mv
        return op.MultiHeadAttention(q, k, v, key_bias, zk, zv, _domain=DOMAIN, _allow_other_attributes=True,
                                     _outputs=["y"])

    def check(self, context, mk, mv, zk, zv, ck=None, cv=None, **_):
        result = pattern.MatchResult()
        for side, zero, bias, x in (("k", zk, ck, mk), ("v", zv, cv, mv)):
            if side in self._fold:
                result = check_zero_bias_to_fold(result, zero, bias, x)
                if not result:
                    return result
        return result

    def rewrite(self, op, q, mk, mv, key_bias, zk, zv, y, ck=None, cv=None, **_):
        node = y.producer()
        return MULTI_HEAD_ATTENTION.node(op, q, mk, mv, key_bias, zk if ck is None else ck, zv if cv is None else cv,
                                         num_heads=node.attributes.get_int("num_heads", 1),
                                         scale=node.attributes.get_float("scale", 1.0))
