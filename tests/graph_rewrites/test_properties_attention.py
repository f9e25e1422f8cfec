"""Property tests (hypothesis) for the encoder attention rules (attention, attention_onnx, attention_onnx_3d and
attention_bias; graph_rewrites/attention.py, mask.py): generated self-attention graphs are either fused into
ai.ort_triton.MultiHeadAttention with the right num_heads and scale and give the original's outputs (ORT CPU,
function bodies), or left alone with the reason in the report. Never a changed result.

Decomposed attention (opset 15/17/18/20), every form drawn independently:
- sizes: batch and sequence 1..9, dynamic ("batch", "seq") or static dims; heads 1..4; head dims of HEAD_DIMS;
  float32 or float16 (compared at 1e-5 / 1e-2 relative);
- head split Reshape to [0, 0, N, D], [0, 0, -1, D], [0, 0, N, -1] or Concat(Shape(x)[:2], [N, D]) (and the
  matching merge); K^T by the perm on the head split, a second Transpose, or dynamo's [B*N, S, D] flatten;
- scale: Div by sqrt(D), Mul by 1/sqrt(D), Q and K^T each times D^-1/4, none, at the default or another value;
- padding mask from a 2-D int64/int32/float attention_mask: none; (1 - Cast(m)) * fill (BERT's); transformers'
  inverted.masked_fill(inverted.bool(), fill) (Cast/Sub/Cast/Where); Where(keep, 0, fill) added or
  Where(keep, scores, fill) selecting; each [B, 1, 1, S] or Expanded to [B, 1, S, S]; ViT's all-True mask from
  shapes only; fills finfo.min, -1e4, -1e9, -inf (with sdpa's IsNaN/Where guard); a fully padded row or not;
- a same-type Cast pair after the softmax; Softmax axis -1 or 3;
- constants (scales, shapes, fills) as initializers or Constant nodes; Q/K/V projections with or without a
  bias, weights shared by Q and K, K and V, or all three; one layer or two (the second with the first's
  weights or its own) reading one mask; K's projection also read elsewhere (fuses; its bias stays);
- one defect per refusal test: float64, head dim 16/24/48, a scale computed at run time, a zero scale,
  Softmax over axis 2, a fill that drops nothing (-1), -inf without the guard, and the probabilities, the raw
  scores, the masked logits or V's heads also read elsewhere (as a graph output or by another computation):
  those must not fuse, and the other layer of a two-layer model still does.
ONNX Attention (opset 23): 4-D heads split/merged around it or 3-D with q_num_heads; no mask, a boolean
[B, 1, S, S] mask, an all-True one, Where(keep, 0, -inf); default or explicit scale; K/V biases or not;
defects: float64, head dims 16/24/48, grouped-query heads, is_causal, softcap, present_key read, the 4-D Q read
elsewhere, a finite additive mask (Where(keep, 0, finfo.min) or (1 - m) * finfo.min).
A few draws of both run the whole pipeline, which must fuse the same.

Findings, each fixed, with a test at the end: commuted Add/Mul operands; K/V biases that did not fold
without a mask; a shape-only mask refused at a static batch > 1; float16 Where(keep, scores, finite fill)
changed fully padded rows (now refused, and drawn by the generators as a defect).
"""

import math

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from ort_triton.ops.attention import HEAD_DIMS

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MHA = "ai.ort_triton.MultiHeadAttention"
DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64}
TOL = {"float32": 1e-5, "float16": 1e-2, "float64": 1e-5}
MASK_DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32}

# The rules under test. optimize() with every rule costs ~1 s a model here (it builds the commuted variants of
# every pattern) against ~0.05 s with these, so the generated cases run these, many of them, and
# test_the_whole_pipeline_fuses_the_same runs every rule on a few.
ATTENTION_RULES = [r.name for r in graph_rewrites.RULES if r.name.startswith("attention")]
# the projection packers: pack_qkv after a fused attention; pack_projections packs the Q/K/V MatMuls of one input
# that an attention rule left unfused (an ONNX Attention it refuses): both belong with the attention rules here
PACKERS = ["pack_qkv", "pack_projections"]
MANY = settings(SETTINGS, max_examples=60)  # the forms that fuse, per element type
FEW = settings(SETTINGS, max_examples=15)  # each kind of refusal


class Builder:
    """Nodes, initializers and extra outputs of one model, with fresh names; constants (scales, shapes, mask
    fills) are initializers or Constant nodes, weights always initializers."""

    def __init__(self, rng, dtype, const_nodes):
        self.nodes, self.inits, self.outputs, self.rng = [], [], [], rng
        self.dtype, self.const_nodes, self._n = dtype, const_nodes, 0

    def name(self, hint):
        self._n += 1
        return f"{hint}_{self._n}"

    def tensor(self, value, dtype, name):
        return numpy_helper.from_array(np.asarray(value, dtype), name)

    def const(self, value, dtype=None, hint="c"):
        name = self.name(hint)
        t = self.tensor(value, dtype or self.dtype, name)
        if self.const_nodes:
            self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=t))
        else:
            self.inits.append(t)
        return name

    def weight(self, value, hint):
        name = self.name(hint)
        self.inits.append(self.tensor(value, self.dtype, name))
        return name

    def ints(self, *values):
        return self.const(list(values), np.int64, "i")

    def op(self, op_type, *inputs, outputs=1, **attrs):
        outs = [self.name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=outs[0], **attrs))
        return outs[0] if outputs == 1 else outs


def _run(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _same(model, out, feeds, rel=1e-5):
    """Every output equal: NaN and +-inf where the original has them (a leaked mask, a fully padded row
    without a guard), the rest within rel of the largest finite value."""
    for a, b in zip(_run(model, feeds), _run(out, feeds), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        a, b = a.astype(np.float64), b.astype(np.float64)
        finite = np.isfinite(a)
        assert np.array_equal(a[~finite], b[~finite], equal_nan=True) and np.isfinite(b[finite]).all()
        if finite.any():
            scale = max(np.abs(a[finite]).max(), 1e-6)
            assert np.abs(a[finite] - b[finite]).max() <= rel * scale + 1e-6


def _refusals(rep) -> list[str]:
    return [r.reason for s in rep.rules.values() for r in s.refused]


def _reduce_mean(b, x, axes, opset):
    if opset >= 18:
        return b.op("ReduceMean", x, b.ints(*axes), keepdims=0)
    return b.op("ReduceMean", x, axes=axes, keepdims=0)


def _split(b, x, p):
    """x [B, S, N*D] -> [B, S, N, D] by the drawn Reshape target."""
    n, d = p["n"], p["d"]
    shape = {"nd": lambda: b.ints(0, 0, n, d), "neg_n": lambda: b.ints(0, 0, -1, d),
             "neg_d": lambda: b.ints(0, 0, n, -1),
             # torchscript's: the leading dims read from the tensor
             "shape": lambda: b.op("Concat", b.op("Shape", x, start=0, end=2), b.ints(n, d), axis=0)}[p["split"]]()
    return b.op("Reshape", x, shape)


def _merge(b, ctx, x, p):
    h = p["n"] * p["d"]
    shape = {"nd": lambda: b.ints(0, 0, h), "neg_n": lambda: b.ints(0, 0, -1), "neg_d": lambda: b.ints(0, 0, -1),
             "shape": lambda: b.op("Concat", b.op("Shape", x, start=0, end=2), b.ints(h), axis=0)}[p["split"]]()
    return b.op("Reshape", b.op("Transpose", ctx, perm=[0, 2, 1, 3]), shape)


def _key_transposed(b, k, p):
    """K^T [B, N, D, S] in the exporters' forms."""
    split = _split(b, k, p)
    if p["k_form"] == "direct":  # eager: the perm on the head split
        return b.op("Transpose", split, perm=[0, 2, 3, 1])
    k4 = b.op("Transpose", split, perm=[0, 2, 1, 3])
    if p["k_form"] == "double":
        return b.op("Transpose", k4, perm=[0, 1, 3, 2])
    # dynamo's sdpa: [B, N, S, D] -> [B*N, S, D] -> transpose -> [B, N, D, S], shapes read from K
    shape = b.op("Shape", k4)
    flat = b.op("Concat", b.ints(-1), b.op("Slice", shape, b.ints(-2), b.ints(4)), axis=0)
    back = b.op("Concat", b.op("Slice", shape, b.ints(0), b.ints(2)), b.op("Slice", shape, b.ints(3), b.ints(4)),
                b.op("Slice", shape, b.ints(2), b.ints(3)), axis=0)
    return b.op("Reshape", b.op("Transpose", b.op("Reshape", k4, flat), perm=[0, 2, 1]), back)


def _mask(b, am, p):
    """(how it is applied, value) for the drawn mask form, built once and read by every layer."""
    form, dt = p["mask"], p["dtype"]
    if form == "none":
        return None
    t = helper.np_dtype_to_tensor_dtype(np.dtype(DTYPES[dt]))

    def square(x):  # [B, 1, 1, S] -> [B, 1, S, S], as transformers expands it
        if not p["expand"]:
            return x
        s = b.op("Shape", am, start=1, end=2)
        return b.op("Expand", x, b.op("Concat", b.ints(1, 1), s, s, axis=0))

    fill = b.const(p["fill"])
    if form == "sub_mul":  # BERT's (1 - mask[:, None, None, :]) * finfo.min
        ext = square(b.op("Unsqueeze", b.op("Cast", am, to=t), b.ints(1, 2)))
        return "add", b.op("Mul", b.op("Sub", b.const(1.0), ext), fill)
    if form == "hf_where":  # transformers' _prepare_4d_attention_mask: inverted.masked_fill(inverted.bool(), min)
        inverted = b.op("Sub", b.const(1.0), square(b.op("Cast", b.op("Unsqueeze", am, b.ints(1, 2)), to=t)))
        return "add", b.op("Where", b.op("Cast", inverted, to=TensorProto.BOOL), fill, inverted)
    if form == "keep_all":  # ViT's: Expand(True, [B, 1, S, S]) from shapes only
        s = b.op("Shape", am, start=1, end=2)
        keep = b.op("Expand", b.const(True, np.bool_),
                    b.op("Concat", b.op("Shape", am, start=0, end=1), b.ints(1), s, s, axis=0))
    else:
        keep = square(b.op("Unsqueeze", b.op("Cast", am, to=TensorProto.BOOL), b.ints(1, 2)))
    if p["mask_as"] == "select":  # Where(keep, scores, fill)
        return "select", (keep, fill)
    return "add", b.op("Where", keep, b.const(0.0), fill)


def _projection(b, x, w):
    weight, bias = w
    y = b.op("MatMul", x, weight)
    return b.op("Add", y, bias) if bias else y


def _weights(b, p):
    """Q, K, V (weight, bias or None), some sharing an initializer as drawn."""
    h = p["n"] * p["d"]
    out = {}
    for key, with_bias in zip("qkv", p["biases"]):
        same = p["shared"] if key in p["shared"] else ""
        if same and same[0] != key:  # the first of the group owns the initializer
            out[key] = (out[same[0]][0], b.weight(b.rng.normal(0, 0.2, h), "b") if with_bias else None)
            continue
        out[key] = (b.weight(b.rng.normal(0, h ** -0.5, (h, h)), "w"),
                    b.weight(b.rng.normal(0, 0.2, h), "b") if with_bias else None)
    return out


def _layer(b, x, mask, p, w, leak):
    """One self-attention the way exporters write it; `leak` names an inner value also read elsewhere."""
    q, k, v = (_projection(b, x, w[key]) for key in "qkv")
    q4, kt = b.op("Transpose", _split(b, q, p), perm=[0, 2, 1, 3]), _key_transposed(b, k, p)
    v4 = b.op("Transpose", _split(b, v, p), perm=[0, 2, 1, 3])
    form, c = p["scale"], p["scale_const"]
    mul = lambda x: b.op("Mul", *((b.const(c), x) if p["swap_scale"] else (x, b.const(c))))  # noqa: E731
    if form == "qk":  # sdpa: each of Q and K^T by D^-1/4
        q4, kt = mul(q4), mul(kt)
    qk = scores = b.op("MatMul", q4, kt)
    if form == "mul":
        scores = mul(qk)
    elif form == "div":
        scores = b.op("Div", qk, b.const(c))
    elif form == "runtime":  # sqrt(D) from Q's shape: not a constant the rule can read
        dim = b.op("Cast", b.op("Shape", q4, start=3, end=4), to=helper.np_dtype_to_tensor_dtype(
            np.dtype(DTYPES[p["dtype"]])))
        scores = b.op("Div", qk, b.op("Sqrt", dim))
    logits = scores
    if mask is not None and mask[0] == "add":
        logits = b.op("Add", *((mask[1], scores) if p["swap_add"] else (scores, mask[1])))
    elif mask is not None:
        logits = b.op("Where", mask[1][0], scores, mask[1][1])
    probs = b.op("Softmax", logits, axis=p["axis"])
    guarded = probs
    if p["guard"]:  # sdpa's: fully masked rows (-inf everywhere) give NaN, written as 0
        guarded = b.op("Where", b.op("IsNaN", probs), b.const(0.0), probs)
    if p["cast_probs"]:  # softmax(dtype=float32).to(dtype) on a model of that type
        to = helper.np_dtype_to_tensor_dtype(np.dtype(DTYPES[p["dtype"]]))
        guarded = b.op("Cast", b.op("Cast", guarded, to=to), to=to)
    y = _merge(b, b.op("MatMul", guarded, v4), q, p)
    if leak != "none":
        value = {"probs": probs, "qk": qk, "logits": logits, "v_heads": v4, "k_proj": k}[leak]
        if p["leak_as"] == "output":
            b.outputs.append(value)
        else:  # a bounded reader that feeds the output: tanh, then the mean over heads and keys
            axes = [2] if leak == "k_proj" else [1, 3]
            y = b.op("Add", y, b.op("Unsqueeze", _reduce_mean(b, b.op("Tanh", value), axes, p["opset"]), b.ints(2)))
    return y


FILLS = ("min", "min", -1e4, -1e9, -math.inf)  # "min": finfo(dtype).min; -1e9 is -inf in float16
LEAKS = ("probs", "qk", "logits", "v_heads")  # inner values: a reader outside keeps the layer unfused

# One decomposed layer that every rule claims: the variants below override some of these.
BASE = dict(dtype="float32", n=2, d=32, batch=3, seq=5, static=False, opset=17, split="nd", k_form="direct",
            scale="mul", scale_value=None, swap_scale=False, mask="where", mask_as="add", expand=False,
            swap_add=False, fill="min", guard=False, cast_probs=False, axis=-1, mask_dtype="int64",
            padded_row=True, const_nodes=False, biases=(True, True, True), shared="", leak="none",
            leak_as="output", layers=1, share_layers=False, seed=0)


def _derive(p):
    """The values the model stores (rounded to its type) and the scale they mean."""
    dtype = DTYPES[p["dtype"]]
    if p["fill"] == "min":
        p["fill"] = float(np.finfo(dtype).min)
    elif -math.inf < p["fill"] < -float(np.finfo(dtype).max):
        p["fill"] = -math.inf  # -1e9 in float16
    v = p["d"] ** -0.5 if p["scale_value"] is None else p["scale_value"]
    c = {"div": 1 / v if v else 0.0, "mul": v, "qk": math.sqrt(v)}.get(p["scale"], 1.0)
    p["scale_const"] = c = float(np.asarray(c, dtype))
    p["expected_scale"] = {"div": 1 / c if c else 0.0, "mul": c, "qk": c * c}.get(p["scale"], 1.0)
    return p


def params(**overrides):
    return _derive({**BASE, **overrides})


def _scale_values(dtype):
    """None (the default 1/sqrt(D)) or another scale; in float16 at most 0.3: larger ones make the logits so
    large that float16 rounding alone moves the softmax by more than the 1e-2 tolerance."""
    return st.one_of(st.just(None), st.floats(0.05, 0.3 if dtype == "float16" else 2.0))


DECOMPOSED_DEFECTS = ("double", "head_dim", "runtime_scale", "zero_scale", "softmax_axis", "fill_keeps_keys",
                      "unguarded_inf", "inner_leak", "fp16_select_fill")


@st.composite
def decomposed_params(draw, defect=None, dtype=None):
    """A layer the rule claims, in one of its forms, with one thing it must refuse unless `defect` is "none"
    (None: drawn). decomposed_defects, not this, says what the rule must do."""
    if defect is None:
        defect = draw(st.sampled_from(("none",) * 8 + DECOMPOSED_DEFECTS))
    dtype = dtype or draw(st.sampled_from(["float32"] * 3 + ["float16"]))
    p = dict(dtype=dtype, n=draw(st.integers(1, 4)),
             d=draw(st.sampled_from(HEAD_DIMS)), batch=draw(st.integers(1, 9)), seq=draw(st.integers(1, 9)),
             static=draw(st.booleans()), opset=draw(st.sampled_from([15, 17, 18, 20])),
             split=draw(st.sampled_from(["nd", "neg_n", "neg_d", "shape"])),
             k_form=draw(st.sampled_from(["direct", "double", "flat"])),
             scale=draw(st.sampled_from(["div", "mul", "qk", "none"])),
             scale_value=draw(_scale_values(dtype)), swap_scale=draw(st.booleans()), swap_add=draw(st.booleans()),
             mask=draw(st.sampled_from(["none", "sub_mul", "hf_where", "where", "keep_all"])),
             mask_as=draw(st.sampled_from(["add", "select"])), expand=draw(st.booleans()),
             fill=draw(st.sampled_from(FILLS)), guard=draw(st.booleans()), cast_probs=draw(st.booleans()),
             axis=draw(st.sampled_from([-1, 3])), mask_dtype=draw(st.sampled_from(list(MASK_DTYPES))),
             padded_row=draw(st.booleans()), const_nodes=draw(st.booleans()),
             biases=draw(st.tuples(*[st.booleans()] * 3)), shared=draw(st.sampled_from(["", "qk", "kv", "qkv"])),
             leak=draw(st.sampled_from(["none", "none", "k_proj"])),
             leak_as=draw(st.sampled_from(["output", "consumer"])),
             layers=draw(st.integers(1, 2)), share_layers=draw(st.booleans()), seed=draw(st.integers(0, 2**31)))
    if defect == "double":
        p["dtype"] = "float64"
    elif defect == "head_dim":
        p["d"] = draw(st.sampled_from([16, 24, 48]))
    elif defect == "runtime_scale":
        p["scale"] = "runtime"
    elif defect == "zero_scale":
        p["scale"], p["scale_value"] = draw(st.sampled_from(["div", "mul", "qk"])), 0.0
    elif defect == "softmax_axis":
        p["axis"] = 2
    elif defect in ("fill_keeps_keys", "unguarded_inf"):
        p["mask"] = draw(st.sampled_from(["sub_mul", "hf_where", "where"] if defect == "fill_keeps_keys"
                                         else ["hf_where", "where"]))
        p["fill"], p["guard"] = (-1.0, p["guard"]) if defect == "fill_keeps_keys" else (-math.inf, False)
    elif defect == "inner_leak":
        p["leak"] = draw(st.sampled_from(LEAKS))
    elif defect == "fp16_select_fill":
        p.update(dtype="float16", mask="where", mask_as="select", fill=draw(st.sampled_from(["min", -1e4])))
    p = params(**p)
    if defect != "fp16_select_fill" and _fp16_select_fill(p):
        p["mask_as"] = "add"  # that form is the defect above
    if p["fill"] == -math.inf:  # -inf, or -1e9 in float16
        if p["mask"] == "sub_mul":  # (1 - 1) * -inf is NaN: no exporter writes it
            p["fill"] = float(np.finfo(DTYPES[p["dtype"]]).min)
        elif defect != "unguarded_inf":
            p["guard"] = True  # -inf comes with sdpa's IsNaN guard
    return p


def _fp16_select_fill(p) -> bool:
    return p["dtype"] == "float16" and p["mask"] == "where" and p["mask_as"] == "select" and math.isfinite(p["fill"])


def _attention_mask(rng, p):
    """0/1 [B, S]: row 0 unpadded, the last fully padded if drawn (where the two meanings of a fill differ),
    and else none fully padded."""
    keep = rng.random((p["batch"], p["seq"])) < 0.6
    keep[0] = True
    if p["padded_row"]:
        keep[-1] = False
    else:
        keep[~keep.any(1), 0] = True
    return keep


def decomposed_model(p):
    rng = np.random.default_rng(p["seed"])
    dtype = DTYPES[p["dtype"]]
    b = Builder(rng, dtype, p["const_nodes"])
    h = p["n"] * p["d"]
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    batch, seq = (p["batch"], p["seq"]) if p["static"] else ("batch", "seq")
    mask = _mask(b, "attention_mask", p)
    w = _weights(b, p)
    y = _layer(b, "x", mask, p, w, p["leak"])
    if p["layers"] == 2:
        y = _layer(b, y, mask, p, w if p["share_layers"] else _weights(b, p), "none")
    graph = helper.make_graph(
        b.nodes, "attention",
        [helper.make_tensor_value_info("x", t, [batch, seq, h]),
         helper.make_tensor_value_info("attention_mask", helper.np_dtype_to_tensor_dtype(
             np.dtype(MASK_DTYPES[p["mask_dtype"]])), [batch, seq])],
        [helper.make_tensor_value_info(y, t, [batch, seq, h])]
        + [helper.make_tensor_value_info(o, t, None) for o in b.outputs], initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", p["opset"])], ir_version=10)
    feeds = {"x": rng.normal(0, 1, (p["batch"], p["seq"], h)).astype(dtype),
             "attention_mask": _attention_mask(rng, p).astype(MASK_DTYPES[p["mask_dtype"]])}
    return model, feeds


def decomposed_defects(p) -> list[str]:
    """What makes the rule refuse every layer: the start of its reason for each."""
    out = []
    if p["dtype"] == "float64":
        out.append("element type DOUBLE")
    if p["d"] not in HEAD_DIMS:
        out.append(f"head dim {p['d']} not in")
    if p["scale"] == "runtime" or (p["scale"] in ("div", "mul", "qk") and p["scale_const"] == 0):
        out.append("is not a finite nonzero constant scalar")
    if p["axis"] == 2:
        out.append("Softmax over axis 2")
    if p["mask"] not in ("none", "keep_all"):
        fill = p["fill"]
        if not fill <= -1e4:
            out.append("does not drop them" if p["mask"] != "where" or p["mask_as"] == "add"
                       else "is not a constant <=")
        elif fill == -math.inf and not p["guard"]:
            out.append("gives NaN here")
        elif _fp16_select_fill(p):
            out.append("cannot give in float16")
    return out


def onnx_attention_model(p):
    """ONNX Attention (opset 23) on [B, N, S, D] heads split from and merged to the projections, or on the
    3-D projections with q_num_heads."""
    rng = np.random.default_rng(p["seed"])
    dtype = DTYPES[p["dtype"]]
    b = Builder(rng, dtype, p["const_nodes"])
    n, d, kv = p["n"], p["d"], p["kv_heads"]
    h = n * d
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    batch, seq = (p["batch"], p["seq"]) if p["static"] else ("batch", "seq")
    x, am = "x", "attention_mask"
    q = _projection(b, x, (b.weight(rng.normal(0, h ** -0.5, (h, h)), "w"), b.weight(rng.normal(0, 0.2, h), "b")))
    k, v = (_projection(b, x, (b.weight(rng.normal(0, h ** -0.5, (h, kv * d)), "w"),
                               b.weight(rng.normal(0, 0.2, kv * d), "b") if with_bias else None))
            for with_bias in p["biases"])
    if p["four_d"]:
        heads = lambda y, m: b.op("Transpose", b.op("Reshape", y, b.ints(0, 0, m, d)), perm=[0, 2, 1, 3])  # noqa: E731
        inputs = [heads(q, n), heads(k, kv), heads(v, kv)]
        if p["leak"]:  # the 4-D Q is read elsewhere too
            b.outputs.append(inputs[0])
    else:
        inputs = [q, k, v]
    s = b.op("Shape", am, start=1, end=2)
    keep = b.op("Unsqueeze", b.op("Cast", am, to=TensorProto.BOOL), b.ints(1, 2))
    square = b.op("Expand", keep, b.op("Concat", b.ints(1, 1), s, s, axis=0))
    form = p["mask"]
    if form == "bool":
        inputs.append(square)  # ORT CPU takes no mask whose query axis is 1
    elif form == "keep_all":  # from shapes only
        inputs.append(b.op("Expand", b.const(True, np.bool_),
                           b.op("Concat", b.op("Shape", am, start=0, end=1), b.ints(1), s, s, axis=0)))
    elif form in ("add_inf", "add_min"):  # additive, square: ORT does not broadcast its query axis
        inputs.append(b.op("Where", square, b.const(0.0), b.const(-math.inf if form == "add_inf"
                                                                  else float(np.finfo(dtype).min))))
    elif form == "sub_mul":
        ext = b.op("Cast", b.op("Unsqueeze", am, b.ints(1, 2)), to=t)
        inputs.append(b.op("Expand", b.op("Mul", b.op("Sub", b.const(1.0), ext), b.const(float(np.finfo(dtype).min))),
                           b.op("Concat", b.ints(1, 1), s, s, axis=0)))
    attrs = {}
    if p["scale_value"] is not None:
        attrs["scale"] = p["scale_value"]
    if p["is_causal"]:
        attrs["is_causal"] = 1
    if p["softcap"]:
        attrs["softcap"] = 5.0
    if not p["four_d"]:
        attrs.update(q_num_heads=n, kv_num_heads=kv)
    outs = b.op("Attention", *inputs, outputs=3 if p["present"] else 1, **attrs)
    y = outs[0] if p["present"] else outs
    if p["present"]:
        b.outputs.append(outs[1])
    if p["four_d"]:
        y = b.op("Reshape", b.op("Transpose", y, perm=[0, 2, 1, 3]), b.ints(0, 0, h))
    graph = helper.make_graph(
        b.nodes, "attention",
        [helper.make_tensor_value_info(x, t, [batch, seq, h]),
         helper.make_tensor_value_info(am, TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info(y, t, [batch, seq, h])]
        + [helper.make_tensor_value_info(o, t, None) for o in b.outputs], initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    return model, {x: rng.normal(0, 1, (p["batch"], p["seq"], h)).astype(dtype),
                   am: _attention_mask(rng, p).astype(np.int64)}


def _optimize(model, only=ATTENTION_RULES):
    return graph_rewrites.optimize(model, report=True, only=only)


def _events(fused, layers, defects):
    """For --hypothesis-show-statistics: how many draws fused, and why the others did not."""
    event(f"fused {fused} of {layers} layer(s)")
    for why in defects:
        event(f"refused: {why}")


def _mha_nodes(out):
    return [nd for nd in out.graph.node if nd.op_type == "MultiHeadAttention"]


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _check_fused_nodes(out, n, scale):
    for node in _mha_nodes(out):
        attrs = _attrs(node)
        assert attrs["num_heads"] == n and math.isclose(attrs["scale"], scale, rel_tol=1e-6), attrs


def _check_bias_folds(rep, expected, refused=False):
    """attention_bias folds the K and V projection biases of `expected` fused layers, with a mask or without
    (the zero key bias of a layer without one reads x's shape, not K's); `refused`: one more has both but
    K's sum is read elsewhere, which must be refused."""
    st_ = rep.rules["attention_bias"]
    reasons = [r.reason for r in st_.refused]
    assert st_.matched == expected, (st_, _refusals(rep))
    if refused:
        assert any("used outside" in r for r in reasons), reasons


def _check_decomposed(p) -> int:
    """Fused as decomposed_defects says, with the right attributes, or refused with the reason; the outputs
    equal in every case. Returns the layers fused."""
    model, feeds = decomposed_model(p)
    out, rep = _optimize(model)
    _same(model, out, feeds, TOL[p["dtype"]])
    defects = decomposed_defects(p)
    inner_leak = p["leak"] in LEAKS
    expected = 0 if defects else p["layers"] - inner_leak
    _events(expected, p["layers"], defects or (["an inner value read elsewhere"] if inner_leak else []))
    att, after = rep.rules["attention"], rep.ops_after
    assert att.matched == after[MHA] == expected, (p, att, _refusals(rep))
    assert after["Softmax"] == p["layers"] - expected, dict(after)
    if expected < p["layers"]:  # the reason names what is wrong
        wanted = defects + (["used outside"] if inner_leak else [])  # the rule may meet either first
        assert any(w in r for r in _refusals(rep) for w in wanted), (wanted, _refusals(rep))
    _check_fused_nodes(out, p["n"], p["expected_scale"])
    if expected:
        both, k_read = p["biases"][1] and p["biases"][2], p["leak"] == "k_proj"
        _check_bias_folds(rep, both * (expected - k_read), both and k_read)
    return expected


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_packing_the_projections_keeps_results(dtype, data):
    """pack_qkv after the attention rules: the outputs stay; every fused layer is packed where no projection
    is read elsewhere (its K and V biases folded by attention_bias, or one alone by attention_bias_one); the
    rest stay MultiHeadAttention."""
    p = data.draw(decomposed_params("none", dtype), label="p")
    model, feeds = decomposed_model(p)
    out, rep = _optimize(model, ATTENTION_RULES + ["pack_qkv"])
    _same(model, out, feeds, TOL[p["dtype"]])
    fused, after = rep.rules["attention"].matched, rep.ops_after
    packed = after["ai.ort_triton.PackedMultiHeadAttention"]
    assert packed + after[MHA] == fused and packed == rep.rules["pack_qkv"].matched, (after, rep.rules["pack_qkv"])
    event(f"packed {packed} of {fused}")
    if p["leak"] == "none":
        assert packed == fused, (p, rep.rules["pack_qkv"])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@MANY
@given(data=st.data())
def test_decomposed_attention_forms_fuse_and_keep_results(dtype, data):
    p = data.draw(decomposed_params("none", dtype), label="p")
    for what in ("split", "k_form", "scale", "mask", "shared", "leak"):
        event(f"{what}: {p[what]}")
    event(f"mask applied: {p['mask_as'] if p['mask'] in ('where', 'keep_all') else 'add'}")
    event(f"constants: {'Constant nodes' if p['const_nodes'] else 'initializers'}")
    assert _check_decomposed(p) == p["layers"]


@pytest.mark.parametrize("defect", DECOMPOSED_DEFECTS)
@FEW
@given(data=st.data())
def test_decomposed_attention_defects_are_refused_with_a_reason(defect, data):
    p = data.draw(decomposed_params(defect), label="p")
    assert _check_decomposed(p) < p["layers"]


ONNX_DEFECTS = ("double", "head_dim", "grouped_query", "is_causal", "softcap", "present_read", "inner_leak",
                "finite_mask")


@st.composite
def onnx_attention_params(draw, defect=None, dtype=None):
    """As decomposed_params, for ONNX Attention (opset 23)."""
    if defect is None:
        defect = draw(st.sampled_from(("none",) * 6 + ONNX_DEFECTS))
    n = draw(st.integers(1, 4))
    dtype = dtype or draw(st.sampled_from(["float32"] * 3 + ["float16"]))
    p = dict(dtype=dtype, n=n,
             d=draw(st.sampled_from(HEAD_DIMS)),
             kv_heads=n, batch=draw(st.integers(1, 9)), seq=draw(st.integers(1, 9)), static=draw(st.booleans()),
             four_d=draw(st.booleans()), leak=False,
             mask=draw(st.sampled_from(["none", "bool", "keep_all", "add_inf"])),
             scale_value=draw(_scale_values(dtype)), is_causal=False, softcap=False,
             present=False, biases=draw(st.tuples(st.booleans(), st.booleans())), padded_row=draw(st.booleans()),
             const_nodes=draw(st.booleans()), seed=draw(st.integers(0, 2**31)))
    if defect == "double":
        p["dtype"] = "float64"
    elif defect == "head_dim":
        p["d"] = draw(st.sampled_from([16, 24, 48]))
    elif defect == "grouped_query":
        p["n"] = n = draw(st.sampled_from([2, 4]))
        p["kv_heads"] = draw(st.sampled_from([k for k in range(1, n) if n % k == 0]))
    elif defect == "is_causal":
        p["is_causal"] = True
        if p["dtype"] == "float64" and p["mask"] == "add_inf":
            p["mask"] = "bool"  # ORT CPU cannot run that original (a float constant in its Attention's body)
    elif defect == "softcap":
        p["softcap"] = True
    elif defect == "present_read":
        p["present"] = True
    elif defect == "inner_leak":  # the 4-D Q read elsewhere (the 3-D form has no inner value)
        p["four_d"], p["leak"] = True, True
    elif defect == "finite_mask":
        p["mask"] = draw(st.sampled_from(["add_min", "sub_mul"]))
    return p


def onnx_attention_defects(p) -> list[str]:
    out = []
    if p["dtype"] == "float64":
        out.append("element type DOUBLE")
    if p["kv_heads"] != p["n"]:
        out.append("split into different heads" if p["four_d"] else "kv_num_heads differs")
    if p["d"] not in HEAD_DIMS:
        out.append(f"head dim {p['d']} not in")
    if p["is_causal"]:
        out.append("is_causal=1")
    if p["softcap"]:
        out.append("softcap is set")
    if p["present"]:
        out.append("present key/value or qk_matmul_output are read")
    if p["leak"]:
        out.append("used outside")
    if p["mask"] in ("add_min", "sub_mul"):
        out.append("an additive mask with the finite fill")
    return out


def _check_onnx(p) -> int:
    model, feeds = onnx_attention_model(p)
    out, rep = _optimize(model)
    _same(model, out, feeds, TOL[p["dtype"]])
    rule = "attention_onnx" if p["four_d"] else "attention_onnx_3d"
    defects = onnx_attention_defects(p)
    expected = 0 if defects else 1
    _events(expected, 1, defects)
    assert rep.rules[rule].matched == rep.ops_after[MHA] == expected, (p, _refusals(rep))
    assert rep.ops_after["Attention"] == 1 - expected
    if defects:
        assert any(w in r.reason for r in rep.rules[rule].refused for w in defects), (defects, _refusals(rep))
    scale = p["d"] ** -0.5 if p["scale_value"] is None else float(np.float32(p["scale_value"]))
    _check_fused_nodes(out, p["n"], scale)
    if expected:
        _check_bias_folds(rep, int(all(p["biases"])))
    return expected


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@MANY
@given(data=st.data())
def test_onnx_attention_forms_fuse_and_keep_results(dtype, data):
    p = data.draw(onnx_attention_params("none", dtype), label="p")
    for what in ("four_d", "mask"):
        event(f"{what}: {p[what]}")
    assert _check_onnx(p) == 1


@pytest.mark.parametrize("defect", ONNX_DEFECTS)
@FEW
@given(data=st.data())
def test_onnx_attention_defects_are_refused_with_a_reason(defect, data):
    assert _check_onnx(data.draw(onnx_attention_params(defect), label="p")) == 0


@settings(SETTINGS, max_examples=10)
@given(st.one_of(decomposed_params().map(lambda p: (decomposed_model, p)),
                 onnx_attention_params().map(lambda p: (onnx_attention_model, p))))
def test_the_whole_pipeline_fuses_the_same(case):
    """The other rules (norms, GELU, Gemm, causal attention, ...) leave these graphs to the attention rules."""
    builder, p = case
    model, feeds = builder(p)
    out, rep = _optimize(model, None)
    _same(model, out, feeds, TOL[p["dtype"]])
    others = {name: s.matched for name, s in rep.rules.items()
              if s.matched and name not in ATTENTION_RULES + PACKERS}
    if p["static"] and p["seq"] == 1:  # one key: a padding mask is causal too, and those rules may take it
        assert set(others) <= {"causal_attention", "causal_attention_onnx"}, others
        return
    _, alone = _optimize(model, ATTENTION_RULES + PACKERS)
    assert not others and rep.ops_after == alone.ops_after, (others, rep.ops_after, alone.ops_after)


# ---- findings, each fixed: what the rules now do ---------------------------------------------------------
# A changed result where the finding is not about the result is pytest.fail, not a plain assertion.

def _optimize_checked(p, builder=decomposed_model):
    model, feeds = builder(p)
    out, rep = _optimize(model)
    try:
        _same(model, out, feeds, TOL[p["dtype"]])
    except AssertionError as e:
        pytest.fail(f"a changed result: {e}")
    return out, rep


@pytest.mark.parametrize("overrides", [dict(swap_add=True), dict(swap_add=True, mask="sub_mul"),
                                       dict(swap_scale=True), dict(swap_scale=True, scale="qk")],
                         ids=["mask_add", "mask_sub_mul", "scale_mul", "scale_qk"])
def test_commuted_operands_fuse(overrides):
    """Once a finding (the rule matched Add(scores, mask) and Mul(x, c) only): Add(mask, scores), Mul(c, scores)
    and Mul(c, Q) fuse, with the original's result."""
    _, rep = _optimize_checked(params(**overrides))
    assert rep.rules["attention"].matched == 1, (rep.rules["attention"].best_partial, _refusals(rep))


@pytest.mark.parametrize("mask", ["none", "keep_all"])
def test_projection_biases_fold_without_a_mask(mask):
    """Once a finding (the zero key bias read K's shape, a second reader of K's bias Add): now folded."""
    _, rep = _optimize_checked(params(mask=mask))
    if rep.rules["attention"].matched != 1:
        pytest.fail(f"the layer is not fused: {_refusals(rep)}")
    assert rep.rules["attention_bias"].matched == 1, _refusals(rep)


@pytest.mark.parametrize("builder, overrides", [
    (decomposed_model, {}),
    (onnx_attention_model, dict(four_d=True, kv_heads=2, leak=False, is_causal=False, softcap=False, present=False,
                                biases=(True, True)))], ids=["decomposed", "onnx"])
def test_static_shape_mask_that_keeps_every_key(builder, overrides):
    """Once a finding (a mask that reads no input's values was compared at the sampled batch sizes, not the
    inputs' static batch, and refused at a static batch > 1): it fuses."""
    _, rep = _optimize_checked(params(mask="keep_all", static=True, batch=2, **overrides), builder)
    assert rep.ops_after[MHA] == 1, _refusals(rep)


@pytest.mark.parametrize("fill", [-1e4, "min"])
def test_fp16_select_fill_is_refused(fill):
    """Once a finding (a changed result): float16 Where(keep, scores, fill) fused with key_bias = -65504, which
    in float32 arithmetic shifts a fully padded row's scores instead of swamping them, so that row became
    softmax(scores) V, not the original's mean of V. Now refused, with the reason; the output is the original's."""
    p = params(dtype="float16", mask_as="select", fill=fill, padded_row=True)
    model, feeds = decomposed_model(p)
    out, rep = _optimize(model)
    _same(model, out, feeds, TOL["float16"])
    assert rep.rules["attention"].matched == 0 and any("cannot give in float16" in r for r in _refusals(rep))
