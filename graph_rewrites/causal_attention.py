"""Decoder self-attention over a KV cache -> CausalAttention (contract: ort_triton/ops/causal_attention.py).

Two rules, rooted where the heads are merged back to [B, S, hidden] for o_proj:

    causal_attention:       Reshape(Transpose(MatMul(softmax(Q K'^T * s + mask), V'), [0, 2, 1, 3]))
    causal_attention_onnx:  Reshape(Transpose(Attention(Q, K', V', mask), [0, 2, 1, 3]))   (sdpa at opset 23)

with Q [B, Nq, S, D] (after rotary, or GPT-2's head split), K and V [B, Nkv, T, D] (the present cache: the
Concat of past and new keys, which the graph keeps since it is an output; or the new keys alone without a
cache), and K', V' either those or repeat_kv of them (Unsqueeze axis 2, Expand to [B, Nkv, G, T, D],
Reshape to [B, Nkv*G, T, D]: query head h reads KV head h // G, what the op does without repeating). K'^T
is a Transpose [0, 1, 3, 2] or (dynamo's sdpa) a flatten to [B*N, T, D], a Transpose and an unflatten.
The scale is a Mul or Div of the scores or a Mul of Q and K each (sdpa's D^-1/4); the mask is added
(eager's finfo.min, sdpa's -inf or finfo.min) or selects scores by Where; an IsNaN/Where after the softmax
(sdpa's guard) and Casts to the same type (eager's softmax in fp32) are part of the match.

Every shape fact is checked on symbolic shapes (graph_rewrites/causal_mask.py: ORT's symbolic shape
inference keeps "seq" and "past + seq" through the exporters' reshapes), and the mask is proven exactly
causal-with-offset (query i of S sees keys j <= T - S + i) and key padding from the 2-D attention_mask by
evaluating it. It is then replaced by key_bias = 0 / -inf from attention_mask, and the meaning of a query
row that sees no key (left padding) is kept by `masked_rows`: a -inf fill guarded by IsNaN gives 0
(torchscript's sdpa); a finite fill that swamps every score (finfo.min of fp32/bf16: eager, dynamo's sdpa)
gives the mean of V over all T keys (fp16's finfo.min too: _FP16_MIN says why). Any other fill is refused,
since on such rows the original's result is neither.

Matched nodes are left for the dead-node pass (remove_nodes=False), as in graph_rewrites/attention.py:
the mask subgraph and the shape arithmetic die once every layer is fused.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from ort_triton.ops.causal_attention import CAUSAL_ATTENTION, CAUSAL_HEAD_DIMS

from .attention import _escaping, _scalar, _score_scale
from .causal_mask import CausalMaskProver, CausalPadding, SymbolicShapes, same
from .common import FLOAT_TYPES
from .mask import DROPS

_HEADS = [0, 2, 1, 3]
# A finite fill at or below this swamps any score: s + fill rounds to fill (fp32/bf16 finfo.min), so a row
# that sees no key is uniform over all T keys in the original (masked_rows = 1)
_SWAMPS = -1e30
# An fp16 export fills with fp16's finfo.min, -65504 (dynamo, fp16 weights). On a row that sees a key, a dropped
# key's score s + fill is at most about -65000 (or -inf) against a kept score's few units: exp gives 0, as for
# -inf, so the fused op is exact. On a row that sees no key (a left-padding position) the original's softmax
# is over s + fill rounded to fp16's 32-wide steps there (or NaN where every sum overflows): no meaningful
# value; the op gives the mean of V (masked_rows = 1), as for fp32's finfo.min.
_FP16_MIN = -65504.0 * 0.999


def _all_same(a, b) -> bool:
    return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))


def _repeat(op, x, axes, shape, merge, tag):
    """repeat_kv: Unsqueeze(x, axes), Expand, Reshape (the check proves axes [2] and the shapes)."""
    expanded = op.Expand(op.Unsqueeze(x, axes), shape, _outputs=[f"{tag}_expanded"])
    return op.Reshape(expanded, merge, _allow_other_attributes=True, _outputs=[f"{tag}_repeated"])


class _CausalRule(pattern.RewriteRuleClassBase):
    """Shared checks and the rewrite; `check` of a subclass fills self._plan."""

    def __init__(self, name: str):
        super().__init__(name, remove_nodes=False)
        self._shapes = SymbolicShapes()
        self._prover = CausalMaskProver()

    def _mask(self, result, context, mask, qd, kd) -> CausalPadding | pattern.MatchResult:
        proof = self._prover.prove(context.model, mask, qd[0], qd[2], kd[2])
        return result.fail(proof, mask) if isinstance(proof, str) else proof

    @staticmethod
    def _source(context, proof: CausalPadding) -> ir.Value | None:
        if proof.source is None:
            return None
        return next(i for i in context.graph_or_function.inputs if i.name == proof.source)

    def _no_escape(self, result, context) -> pattern.MatchResult | None:
        leak = _escaping(context.nodes, context.root)
        if leak is not None:
            return result.fail(f"{leak.name}, computed inside the attention, is also used outside it", leak)
        return None

    def _layout(self, result, model, q, k, k_bsnd, v, out, ctx_kept, repeats):
        """(Q's, K's and the output's symbolic dims) once Q [B, Nq, S, D], K and V [B, Nkv, T, D] (K maybe
        [B, T, Nkv, D], transposed into the scores), each repeat_kv proven, the context kept [B, Nq, S, D]
        and the output [B, S, Nq*D] (or [B*S, Nq*D]); else a failed result."""
        if q.dtype not in FLOAT_TYPES:
            return result.fail(f"element type {q.dtype} is not one of float, float16, bfloat16"
                               if q.dtype else "element type of Q is unknown", q)
        k_in = k if k is not None else k_bsnd
        for x in (k_in, v):
            if x.dtype != q.dtype:
                return result.fail(f"{x.name} is {x.dtype}, Q is {q.dtype}", x)
        dims = lambda x: self._shapes.dims(model, x)
        qd, kd, vd = dims(q), dims(k_in), dims(v)
        for x, d in ((q, qd), (k_in, kd), (v, vd)):
            if isinstance(d, str):
                return result.fail(d, x)
            if d is None or len(d) != 4:
                return result.fail(f"{x.name} is not provably 4-D (symbolic shape {d})", x)
        if k is None:  # [B, T, Nkv, D], transposed into the scores directly
            kd = [kd[0], kd[2], kd[1], kd[3]]
        head_dim = qd[3]
        if not isinstance(head_dim, int) or head_dim not in CAUSAL_HEAD_DIMS:
            return result.fail(f"head dim {head_dim} not in {CAUSAL_HEAD_DIMS} (the kernel's)", q)
        if not (_all_same(kd, vd) and same(kd[0], qd[0]) and same(kd[3], head_dim)):
            return result.fail(f"Q {qd}, K {kd}, V {vd} are not provably [B, Nq, S, D], [B, Nkv, T, D] twice", k_in)
        for (x, value, d), (axes, expanded, repeated) in zip((("K", k_in, kd), ("V", v, vd)), repeats):
            heads = self._kv_heads(model, d, axes, expanded, repeated)
            if isinstance(heads, str):
                return result.fail(f"{x}: {heads}", value)
            if not (same(heads, qd[1]) or same(heads, 1)):
                return result.fail(f"{x} reaches the attention with {heads} heads, Q has {qd[1]}", value)
        nq = qd[1]
        if ctx_kept is not None and not _all_same(dims(ctx_kept), [qd[0], nq, qd[2], head_dim]):
            return result.fail(f"the Reshape of the context to {dims(ctx_kept)} does not provably keep "
                               "[B, N, S, D]", ctx_kept)
        od = dims(out)
        # [B, S, Nq*D], or [B*S, Nq*D] where o_proj is an addmm (GPT-2's Conv1D, dynamo)
        merges = isinstance(od, list) and (
            (len(od) == 3 and same(od[0], qd[0]) and same(od[1], qd[2]) and same(od[2], nq * head_dim))
            or (len(od) == 2 and isinstance(nq, int) and same(od[0], qd[0] * qd[2]) and same(od[1], nq * head_dim)))
        if not merges:
            return result.fail(f"the Reshape to {od} does not provably merge the heads to [B, S, Nq*D]", out)
        return qd, kd, od

    def _kv_heads(self, model, kd, axes, expanded, repeated):
        """The head count K (or V) reaches the scores with: its own, or Nkv * G through repeat_kv (proven
        to be exactly that: a new axis 2, only it broadcast, then merged into the heads)."""
        if repeated is None:
            return kd[1]
        ax = axes.const_value.numpy().reshape(-1).tolist() if axes.const_value is not None else None
        if ax not in ([2], [-3]):
            return f"the Unsqueeze before the Expand is over axes {ax}, not [2] (repeat_kv)"
        ed, rd = self._shapes.dims(model, expanded), self._shapes.dims(model, repeated)
        if not (isinstance(ed, list) and len(ed) == 5 and _all_same([ed[0], ed[1], ed[3], ed[4]], kd)):
            return f"the Expand to {ed} broadcasts more than the new axis of {kd} (not repeat_kv)"
        if not (isinstance(rd, list) and len(rd) == 4 and _all_same([rd[0], rd[2], rd[3]], [kd[0], kd[2], kd[3]])
                and same(rd[1], kd[1] * ed[2])):
            return f"the Reshape to {rd} does not merge [B, Nkv, G] of {ed} into the heads (not repeat_kv)"
        return rd[1]

    @staticmethod
    def _masked_rows(result, proof: CausalPadding, mask, fill, *, guarded: bool):
        """masked_rows that keeps the original's value on rows that see no key, or a failed result."""
        if mask is not None:  # added to the scores
            value = proof.fill
            if value is None:
                return result.fail("the mask added to the scores drops no key at any size", mask)
        else:  # Where(keep, scores, fill)
            if proof.fill is not None:
                return result.fail("the Where condition is not a boolean mask", fill)
            value = _scalar(fill)
            if value is None or not value <= DROPS:
                return result.fail(f"the Where fill {fill.name} is not a constant <= {DROPS:g}", fill)
        if value == -math.inf:
            if not guarded:
                return result.fail("a query that sees no key gives NaN here (a -inf mask and no IsNaN guard); "
                                   "the op gives 0", mask if mask is not None else fill)
            return 0
        if value <= _SWAMPS:
            return 1
        source = mask if mask is not None else fill
        if source is not None and source.dtype == ir.DataType.FLOAT16 and value <= _FP16_MIN:
            return 1  # an fp16 export's finfo.min: exact on every row that sees a key (see _FP16_MIN)
        return result.fail(f"the mask's finite fill {value:g} does not swamp the scores: a query that sees no "
                           "key would be softmax(scores + fill) over all keys, which the op does not compute",
                           mask if mask is not None else fill)

    def rewrite(self, op, **_):
        q, k, k_bsnd, v, scale, rows, source, flat = self._plan
        dtype = q.dtype.numpy()
        if k is None:
            k = op.Transpose(k_bsnd, perm=_HEADS)
        if source is None:  # causal only: a zero bias [B, T]
            shape = op.Gather(op.Shape(k), op.Constant(value_ints=[0, 2]), axis=0)
            key_bias = op.ConstantOfShape(shape, value=ir.tensor(np.zeros(1, dtype)))
        else:
            key_bias = op.Where(op.Cast(source, to=ir.DataType.BOOL), op.Constant(value=ir.tensor(np.array(0, dtype))),
                                op.Constant(value=ir.tensor(np.array(-np.inf, dtype))))
        y = CAUSAL_ATTENTION.node(op, q, k, v, key_bias, scale=scale, masked_rows=rows)
        return y if flat is None else op.Reshape(y, op.Constant(value_ints=[-1, flat]))

class CausalAttentionRule(_CausalRule):
    """softmax(Q K'^T * s + causal padding mask) V', heads merged -> CausalAttention(Q, K, V, key_bias)"""

    def pattern(self, op, q, k, k_bsnd, v, k_axes, k_expand, k_merge, v_axes, v_expand, v_merge, flat_shape,
                unflat_shape, ctx_shape, merge_shape, q_scale, k_scale, s_mul, s_div, mask, keep, fill, nan_zero):
        kr = pattern.OrValue([_repeat(op, k, k_axes, k_expand, k_merge, "k"), k])
        kt = pattern.OrValue([
            op.Transpose(kr, perm=[0, 1, 3, 2], _outputs=["k_transposed"]),
            op.Transpose(k_bsnd, perm=[0, 2, 3, 1]),  # no cache: K's head split and K^T in one Transpose
            op.Reshape(op.Transpose(op.Reshape(kr, flat_shape, _allow_other_attributes=True, _outputs=["k_flat"]),
                                    perm=[0, 2, 1]),
                       unflat_shape, _allow_other_attributes=True, _outputs=["k_unflat"]),
        ])
        qk = op.MatMul(pattern.OrValue([op.Mul(q, q_scale), q]), pattern.OrValue([op.Mul(kt, k_scale), kt]),
                       _outputs=["qk"])
        # the scale and the mask in either operand order (Q's own Mul keeps one: Q is a free variable here, so
        # Mul(c, Q) would bind Q to c and fail the check rather than try the other order)
        scores = pattern.OrValue([op.Mul(qk, s_mul), op.Mul(s_mul, qk), op.Div(qk, s_div), qk])
        logits = pattern.OrValue([op.Add(scores, mask), op.Add(mask, scores),
                                  op.Where(keep, scores, fill)])  # causal: a mask is needed
        probs = op.Softmax(logits, _allow_other_attributes=True, _outputs=["probs"])
        guarded = pattern.OrValue([op.Where(op.IsNaN(probs), nan_zero, probs), probs])
        cast = op.Cast(guarded, _outputs=["cast"])
        guarded = pattern.OrValue([op.Cast(cast, _outputs=["recast"]), cast, guarded])
        vr = pattern.OrValue([_repeat(op, v, v_axes, v_expand, v_merge, "v"), v])
        ctx = op.MatMul(guarded, vr, _outputs=["ctx"])
        ctx = pattern.OrValue([op.Reshape(ctx, ctx_shape, _allow_other_attributes=True, _outputs=["ctx_kept"]), ctx])
        merged = op.Transpose(ctx, perm=_HEADS, _outputs=["merged"])
        return op.Reshape(merged, merge_shape, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, q, v, probs, ctx, merged, out, qk, k=None, k_bsnd=None, k_axes=None, v_axes=None,
              k_expanded=None, k_repeated=None, v_expanded=None, v_repeated=None, k_flat=None, k_unflat=None,
              ctx_kept=None, q_scale=None, k_scale=None, s_mul=None, s_div=None, mask=None, keep=None, fill=None,
              nan_zero=None, cast=None, recast=None, **_):
        result = pattern.MatchResult()
        model = context.model
        softmax = probs.producer()
        if softmax.attributes.get_int("axis", -1) not in (-1, 3):
            return result.fail(f"Softmax over axis {softmax.attributes.get_int('axis', -1)}, not the keys", softmax)
        layout = self._layout(result, model, q, k, k_bsnd, v, out, ctx_kept,
                              [(k_axes, k_expanded, k_repeated), (v_axes, v_expanded, v_repeated)])
        if not isinstance(layout, tuple):
            return layout
        qd, kd, od = layout
        nq, head_dim = qd[1], qd[3]
        if k_flat is not None:
            kr = self._shapes.dims(model, k_repeated) if k_repeated is not None else kd
            fd, ud = self._shapes.dims(model, k_flat), self._shapes.dims(model, k_unflat)
            if not (fd and ud and len(fd) == 3 and same(fd[0], kr[0] * kr[1]) and same(fd[1], kr[2])
                    and same(fd[2], kr[3]) and _all_same(ud, [kr[0], kr[1], kr[3], kr[2]])):
                return result.fail(f"the K reshapes around the [0, 2, 1] Transpose ({fd}, {ud}) are not provably "
                                   "a flatten of [B, N] and its inverse", k_flat)

        scale = _score_scale(result, (q_scale, k_scale, s_mul), s_div, nan_zero, (cast, recast), q.dtype)
        if not isinstance(scale, float):
            return scale
        if (leak := self._no_escape(result, context)) is not None:
            return leak
        proof = self._mask(result, context, mask if mask is not None else keep, qd, kd)
        if not isinstance(proof, CausalPadding):
            return proof
        rows = self._masked_rows(result, proof, mask, fill, guarded=nan_zero is not None)
        if not isinstance(rows, int):
            return rows
        self._plan = (q, k, k_bsnd, v, scale, rows, self._source(context, proof),
                      nq * head_dim if len(od) == 2 else None)
        return result


class CausalOnnxAttentionRule(_CausalRule):
    """Reshape(Transpose(Attention(Q, K', V', mask))) on [B, N, S, D] heads (torch's sdpa at opset 23), K', V'
    the cache or repeat_kv of it -> CausalAttention(Q, K, V, key_bias). Attention's boolean mask (or -inf
    fill) drops keys exactly and gives 0 on a query that sees no key (ORT; masked_rows 0); a finite fill is
    refused, since there ORT's and the spec's meanings differ (graph_rewrites/attention.py)."""

    def pattern(self, op, q, k, v, mask, k_axes, k_expand, k_merge, v_axes, v_expand, v_merge, merge_shape):
        kr = pattern.OrValue([_repeat(op, k, k_axes, k_expand, k_merge, "k"), k])
        vr = pattern.OrValue([_repeat(op, v, v_axes, v_expand, v_merge, "v"), v])
        y = op.Attention(q, kr, vr, mask, _allow_other_attributes=True, _outputs=["y"])  # 4 inputs: no past
        merged = op.Transpose(y, perm=_HEADS, _outputs=["merged"])
        return op.Reshape(merged, merge_shape, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, q, k, v, mask, y, out, k_axes=None, v_axes=None, k_expanded=None, k_repeated=None,
              v_expanded=None, v_repeated=None, **_):
        result = pattern.MatchResult()
        node = y.producer()
        attrs = node.attributes
        if attrs.get_int("is_causal", 0):
            return result.fail("is_causal=1 (upper-left causal, without the cache offset)", node)
        if attrs.get_float("softcap", 0.0):
            return result.fail("softcap is set", node)
        if any(a in attrs for a in ("q_num_heads", "kv_num_heads")):
            return result.fail("Attention on 3-D inputs (q_num_heads) is not this form", node)
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return result.fail("present key/value or qk_matmul_output are read", node)
        layout = self._layout(result, context.model, q, k, None, v, out, None,
                              [(k_axes, k_expanded, k_repeated), (v_axes, v_expanded, v_repeated)])
        if not isinstance(layout, tuple):
            return layout
        qd, kd, od = layout
        if (leak := self._no_escape(result, context)) is not None:
            return leak
        proof = self._mask(result, context, mask, qd, kd)
        if not isinstance(proof, CausalPadding):
            return proof
        if proof.fill is not None and proof.fill != -math.inf:
            return result.fail(f"an additive mask with the finite fill {proof.fill:g}: a query that sees no key is "
                               "defined differently by the ONNX spec and ORT", mask)
        scale = attrs.get_float("scale", 1 / math.sqrt(qd[3]))
        self._plan = (q, k, None, v, scale, 0, self._source(context, proof), qd[1] * qd[3] if len(od) == 2 else None)
        return result
