"""Attention rules on hand-built graphs: every form they claim, and the forms they must refuse.

Each graph is one self-attention over hidden states x [B, S, H] with projections MatMul + bias, the heads
split by Reshape [0, 0, N, D] + Transpose and merged back, and a padding mask built from the 2-D input
attention_mask. Fused graphs must give the original's outputs on ORT CPU through the function bodies,
on two sizes with a fully padded batch row (where the two meanings of the mask's fill differ); refused
ones must be left alone with the reason in the report.
"""

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

N, D = 2, 32
H = N * D
F32_MIN = float(np.finfo(np.float32).min)


class Graph:
    """Nodes and initializers of a model under construction, with fresh names."""

    def __init__(self, dtype=np.float32, hidden=H):
        self.nodes, self.inits, self.dtype, self.hidden, self._n = [], [], dtype, hidden, 0
        self.rng = np.random.default_rng(0)

    def name(self, hint):
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value, dtype=None, hint="c"):
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype or self.dtype), name))
        return name

    def ints(self, *values):
        return self.const(list(values), np.int64, "i")

    def op(self, op_type, *inputs, outputs=1, **attrs):
        outs = [self.name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=outs[0], **attrs))
        return outs[0] if outputs == 1 else outs

    def linear(self, x):
        h = self.hidden
        w = self.const(self.rng.normal(0, 0.3, (h, h)), hint="w")
        return self.op("Add", self.op("MatMul", x, w), self.const(self.rng.normal(0, 0.1, h), hint="b"))


def _heads(g, x, n=N, d=D, shape=None):
    return g.op("Transpose", g.op("Reshape", x, shape or g.ints(0, 0, n, d)), perm=[0, 2, 1, 3])


def _key_transposed(g, k, form, n=N, d=D):
    """K^T [B, N, D, S] in the exporters' forms."""
    split = g.op("Reshape", k, g.ints(0, 0, n, d))
    if form == "direct":  # eager
        return g.op("Transpose", split, perm=[0, 2, 3, 1])
    k4 = g.op("Transpose", split, perm=[0, 2, 1, 3])
    if form == "double":
        return g.op("Transpose", k4, perm=[0, 1, 3, 2])
    # dynamo's sdpa: [B, N, S, D] -> [B*N, S, D] -> transpose -> [B, N, D, S], shapes read from K
    shape = g.op("Shape", k4)
    flat = g.op("Concat", g.ints(-1), g.op("Slice", shape, g.ints(-2), g.ints(4)), axis=0)
    back = g.op("Concat", g.op("Slice", shape, g.ints(0), g.ints(2)), g.op("Slice", shape, g.ints(3), g.ints(4)),
                g.op("Slice", shape, g.ints(2), g.ints(3)), axis=0)
    return g.op("Reshape", g.op("Transpose", g.op("Reshape", k4, flat), perm=[0, 2, 1]), back)


def padding_mask(g, am, *, square=False):
    """keep [B, 1, 1, S] (or [B, 1, S, S], as transformers expands it) from attention_mask."""
    keep = g.op("Unsqueeze", g.op("Cast", am, to=TensorProto.BOOL), g.ints(1, 2))
    if square:
        s = g.op("Shape", am, start=1, end=2)
        keep = g.op("Expand", keep, g.op("Concat", g.ints(1, 1), s, s, axis=0))
    return keep


def causal_padding_mask(g, am):
    """padding AND k <= q: depends on the query position."""
    s = g.op("Squeeze", g.op("Shape", am, start=1, end=2))
    r = g.op("Range", g.const(0, np.int64), s, g.const(1, np.int64))
    tril = g.op("GreaterOrEqual", g.op("Unsqueeze", r, g.ints(1)), g.op("Unsqueeze", r, g.ints(0)))
    return g.op("And", padding_mask(g, am), tril)


def attention(g, x, am, *, scale="mul", k_form="direct", mask="add", fill=F32_MIN, guard=False, mask_fn=None,
              n=N, d=D, cast_probs=False, q_shape=None):
    """One self-attention, the way exporters write it. mask: "add" (Where(keep, 0, fill) + scores),
    "where" (Where(keep, scores, fill)), None; mask_fn(g, am) builds `keep` (default: key padding);
    q_shape(g, x) the target of Q's head split (default [0, 0, n, d])."""
    q4 = _heads(g, g.linear(x), n, d, q_shape(g, x) if q_shape else None)
    kt = _key_transposed(g, g.linear(x), k_form, n, d)
    if scale == "qk":  # sdpa: D^-1/4 on each
        c = g.const(d ** -0.25)
        q4, kt = g.op("Mul", q4, c), g.op("Mul", kt, c)
    scores = g.op("MatMul", q4, kt)
    if scale == "mul":
        scores = g.op("Mul", scores, g.const(1 / math.sqrt(d)))
    elif scale == "div":
        scores = g.op("Div", scores, g.const(math.sqrt(d)))
    elif scale == "runtime":  # sqrt(D) computed from Q's shape: not a constant the rule can read
        dim = g.op("Cast", g.op("Shape", q4, start=3, end=4), to=TensorProto.FLOAT)
        scores = g.op("Div", scores, g.op("Sqrt", dim))
    if mask is not None:
        keep = (mask_fn or padding_mask)(g, am)
        if mask == "add":
            scores = g.op("Add", scores, g.op("Where", keep, g.const(0.0), g.const(fill)))
        else:
            scores = g.op("Where", keep, scores, g.const(fill))
    probs = g.op("Softmax", scores, axis=-1)
    if guard:
        probs = g.op("Where", g.op("IsNaN", probs), g.const(0.0), probs)
    if cast_probs:
        probs = g.op("Cast", g.op("Cast", probs, to=TensorProto.FLOAT), to=TensorProto.FLOAT)
    ctx = g.op("MatMul", probs, _heads(g, g.linear(x), n, d))
    return g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]), g.ints(0, 0, n * d))


def model(build, *, opset=17, hidden=H, dtype=TensorProto.FLOAT, extra_inputs=()):
    """A model y = build(g, "x", "attention_mask") with dynamic batch and sequence."""
    g = Graph(helper.tensor_dtype_to_np_dtype(dtype), hidden)
    y = build(g, "x", "attention_mask")
    inputs = [helper.make_tensor_value_info("x", dtype, ["batch", "seq", hidden]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]), *extra_inputs]
    graph = helper.make_graph(g.nodes, "attention", inputs,
                              [helper.make_tensor_value_info(y, dtype, ["batch", "seq", hidden])],
                              initializer=g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _feeds(m, batch, seq, seed):
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in m.graph.input:
        if i.type.tensor_type.elem_type == TensorProto.INT64:
            a = (rng.random((batch, seq)) < 0.6).astype(np.int64)
            a[0] = 1
            a[-1] = 0  # a fully padded row
            feeds[i.name] = a
        else:
            hidden = i.type.tensor_type.shape.dim[2].dim_value
            feeds[i.name] = rng.normal(size=(batch, seq, hidden)).astype(np.float32)
    return feeds


def assert_same(original, optimized):
    ref = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(optimized.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq in ((3, 6), (2, 9)):
        feeds = _feeds(original, batch, seq, seq)
        (a,), (b,) = ref.run(None, feeds), new.run(None, feeds)
        assert not np.isnan(a).any()
        assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


def fuse(m, rule="attention"):
    # MultiHeadAttention as these rules leave it: packing its projections is tests/graph_rewrites/test_pack_qkv.py
    out, rep = graph_rewrites.optimize(m, report=True, disable=["pack_qkv"])
    st = rep.rules[rule]
    assert st.matched == 1, st
    (node,) = [n for n in out.graph.node if n.op_type == "MultiHeadAttention"]
    assert graph_rewrites.op_counts(out)["Softmax"] == 0
    return out, node


def refusal(m, rule="attention"):
    out, rep = graph_rewrites.optimize(m, report=True, disable=["pack_qkv"])
    st = rep.rules[rule]
    assert st.matched == 0 and st.refused, st
    assert "MultiHeadAttention" not in {n.op_type for n in out.graph.node}
    return st.refused[0].reason


def attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def key_bias_fill(out, node):
    """The fill of the rewritten key_bias Where(Cast(attention_mask), 0, fill)."""
    producers = {o: n for n in out.graph.node for o in n.output}
    where = producers[node.input[3]]
    assert where.op_type == "Where" and producers[where.input[0]].input == ["attention_mask"]
    return float(numpy_helper.to_array(producers[where.input[2]].attribute[0].t))


# ---- forms that fuse ------------------------------------------------------------------------------

@pytest.mark.parametrize("scale, expected", [("mul", D ** -0.5), ("div", D ** -0.5), ("qk", D ** -0.5),
                                             (None, 1.0)])
def test_scale_forms(scale, expected):
    m = model(lambda g, x, am: attention(g, x, am, scale=scale))
    out, node = fuse(m)
    assert attrs(node) == {"num_heads": N, "scale": pytest.approx(expected, rel=1e-6)}
    assert_same(m, out)


@pytest.mark.parametrize("k_form", ["direct", "double", "flat"])
def test_key_transpose_forms(k_form):
    m = model(lambda g, x, am: attention(g, x, am, k_form=k_form))
    out, _ = fuse(m)
    assert_same(m, out)


def test_inputs_are_the_projections_before_the_head_split():
    """Q, K, V are the projections before the head split; K's and V's bias Adds are folded into the op
    (attention_bias), Q's stays."""
    m = model(lambda g, x, am: attention(g, x, am))
    out, node = fuse(m)
    producers = {o: n for n in out.graph.node for o in n.output}
    assert [producers[i].op_type for i in node.input[:3]] == ["Add", "MatMul", "MatMul"]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    assert all(np.any(inits[name]) for name in node.input[4:6])  # the models' own biases, not zeros
    assert graph_rewrites.op_counts(out)["Transpose"] == 0 and graph_rewrites.op_counts(out)["Add"] == 1
    assert_same(m, out)


def test_projection_bias_with_another_reader_is_not_folded():
    """The K projection's sum is also a graph output: its Add must stay, so attention_bias leaves the op's
    biases at zero rather than add k_bias twice."""
    m = model(lambda g, x, am: attention(g, x, am))
    k_sum = [n for n in m.graph.node if n.op_type == "Add"][1].output[0]  # the second projection, K's
    m.graph.output.append(helper.make_tensor_value_info(k_sum, TensorProto.FLOAT, ["batch", "seq", H]))
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.rules["attention"].matched == 1 and rep.rules["attention_bias"].matched == 0
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = _feeds(m, 3, 6, 0)
    for a, b in zip(ref.run(None, feeds), new.run(None, feeds)):
        assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


# eager (finite fill: a fully padded row is the mean of V) and sdpa (-inf and the NaN guard: 0) meanings
@pytest.mark.parametrize("mask, fill, guard, square", [
    ("add", F32_MIN, False, True),  # eager: Where(mask, 0, finfo.min) + scores
    ("add", -1e9, False, False),
    ("add", -math.inf, True, False),  # sdpa, torchscript: Where(mask, 0, -inf) + scores, IsNaN/Where
    ("where", -math.inf, True, True),  # Where(mask, scores, -inf), IsNaN/Where
    ("where", -1e4, False, False),  # a finite select: every dropped score equal, so finfo.min
])
def test_mask_forms_keep_the_meaning_of_fully_padded_rows(mask, fill, guard, square):
    m = model(lambda g, x, am: attention(g, x, am, mask=mask, fill=fill, guard=guard,
                                         mask_fn=lambda g, am: padding_mask(g, am, square=square)))
    out, node = fuse(m)
    expected = F32_MIN if mask == "where" and math.isfinite(fill) else fill
    assert key_bias_fill(out, node) == expected
    assert_same(m, out)


def _assert_fused_with_zero_key_bias(m):
    out, node = fuse(m)
    producers = {o: n for n in out.graph.node for o in n.output}
    assert producers[node.input[3]].op_type == "ConstantOfShape"
    assert_same(m, out)


def test_no_mask_gets_a_zero_key_bias():
    m = model(lambda g, x, am: attention(g, x, am, mask=None))
    _assert_fused_with_zero_key_bias(m)


def test_a_constant_mask_that_keeps_every_key_is_no_mask():
    """ViT's: Expand(True, [B, 1, S, S]) from shapes only."""
    def keep_all(g, am):
        s = g.op("Shape", am, start=1, end=2)
        shape = g.op("Concat", g.op("Shape", am, start=0, end=1), g.ints(1), s, s, axis=0)
        return g.op("Expand", g.const(True, np.bool_), shape)

    m = model(lambda g, x, am: attention(g, x, am, mask_fn=keep_all))
    _assert_fused_with_zero_key_bias(m)


def test_same_type_casts_after_the_softmax():
    m = model(lambda g, x, am: attention(g, x, am, cast_probs=True))
    out, _ = fuse(m)
    assert_same(m, out)


def test_every_layer_shares_one_mask_proof_and_the_mask_subgraph_goes():
    def two_layers(g, x, am):
        return attention(g, attention(g, x, am, mask_fn=lambda g, am: padding_mask(g, am, square=True)), am)

    m = model(two_layers)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.rules["attention"].matched == 2
    counts = graph_rewrites.op_counts(out)
    assert counts["Expand"] == counts["Unsqueeze"] == counts["Softmax"] == 0, counts
    assert_same(m, out)


def test_float32_where_select_gets_float32_finfo_min():
    out, node = fuse(model(lambda g, x, am: attention(g, x, am, mask="where", fill=-1e4)))
    assert key_bias_fill(out, node) == float(np.finfo(np.float32).min)  # swamps the scores: padded rows uniform


def test_refuses_float16_where_select():
    # a fully padded row is the mean of V there; float16's finfo.min would shift its scores, not swamp them
    m = model(lambda g, x, am: attention(g, x, am, mask="where", fill=-1e4), dtype=TensorProto.FLOAT16)
    assert "cannot give in float16" in refusal(m)


# ---- ONNX Attention (opset 23) --------------------------------------------------------------------

def onnx_attention(g, x, am, *, four_d=True, mask="bool", **attention_attrs):
    q, k, v = g.linear(x), g.linear(x), g.linear(x)
    inputs = [_heads(g, q), _heads(g, k), _heads(g, v)] if four_d else [q, k, v]
    if mask == "bool":
        inputs.append(padding_mask(g, am, square=True))
    elif mask is not None:  # an additive mask with this fill (square: ORT does not broadcast its query axis)
        inputs.append(g.op("Where", padding_mask(g, am, square=True), g.const(0.0), g.const(mask)))
    if not four_d:
        attention_attrs.update(q_num_heads=N, kv_num_heads=N)
    y = g.op("Attention", *inputs, **attention_attrs)
    return g.op("Reshape", g.op("Transpose", y, perm=[0, 2, 1, 3]), g.ints(0, 0, H)) if four_d else y


@pytest.mark.parametrize("mask", ["bool", -math.inf, None])
@pytest.mark.parametrize("four_d", [True, False])
def test_onnx_attention(four_d, mask):
    m = model(lambda g, x, am: onnx_attention(g, x, am, four_d=four_d, mask=mask), opset=23)
    out, node = fuse(m, "attention_onnx" if four_d else "attention_onnx_3d")
    assert attrs(node) == {"num_heads": N, "scale": pytest.approx(D ** -0.5)}
    if mask is not None:
        assert key_bias_fill(out, node) == -math.inf  # the spec: a fully masked row is 0
    assert_same(m, out)


def test_onnx_attention_scale_attribute():
    m = model(lambda g, x, am: onnx_attention(g, x, am, scale=0.3), opset=23)
    _, node = fuse(m, "attention_onnx")
    assert attrs(node)["scale"] == pytest.approx(0.3)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(is_causal=1), "is_causal=1"),
    (dict(softcap=5.0), "softcap"),
    (dict(mask=F32_MIN), "fully masked rows are defined differently"),
])
def test_onnx_attention_refusals(kwargs, reason):
    m = model(lambda g, x, am: onnx_attention(g, x, am, **kwargs), opset=23)
    assert reason in refusal(m, "attention_onnx")


def test_onnx_attention_3d_refuses_grouped_query():
    m = model(lambda g, x, am: onnx_attention(g, x, am, four_d=False), opset=23)
    next(n for n in m.graph.node if n.op_type == "Attention").attribute[-1].i = 1  # kv_num_heads
    assert "grouped-query" in refusal(m, "attention_onnx_3d")


# ---- refusals -------------------------------------------------------------------------------------

def test_refuses_a_scale_it_cannot_read():
    m = model(lambda g, x, am: attention(g, x, am, scale="runtime"))
    assert "not a finite nonzero constant scalar" in refusal(m)


def test_refuses_a_causal_mask():
    m = model(lambda g, x, am: attention(g, x, am, mask_fn=causal_padding_mask))
    assert "depends on the query position (causal?)" in refusal(m)


def test_refuses_head_dim_24():
    m = model(lambda g, x, am: attention(g, x, am, n=3, d=24), hidden=72)
    assert "head dim 24 not in (32, 40, 64, 80, 96, 128)" in refusal(m)


def test_refuses_a_mask_that_depends_on_another_input():
    extra = helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["batch", "seq"])

    def both(g, am):
        return g.op("And", padding_mask(g, am), padding_mask(g, "token_type_ids"))

    m = model(lambda g, x, am: attention(g, x, am, mask_fn=both), extra_inputs=[extra])
    assert "depends on the values of attention_mask, token_type_ids" in refusal(m)


def test_refuses_a_mask_that_is_not_key_padding():
    def shifted(g, am):  # keep[b, k] = attention_mask[b, k - 1]: a mask of the keys, but not this one
        padded = g.op("Pad", am, g.ints(0, 1, 0, 0), g.const(1, np.int64))
        return padding_mask(g, g.op("Slice", padded, g.ints(0), g.op("Shape", am, start=1, end=2), g.ints(1)))

    m = model(lambda g, x, am: attention(g, x, am, mask_fn=shifted))
    assert "not a key padding mask" in refusal(m)


def test_refuses_a_fill_that_does_not_drop_keys():
    m = model(lambda g, x, am: attention(g, x, am, fill=-1.0))
    assert "does not drop them" in refusal(m)


def test_refuses_an_unguarded_minus_inf_mask():
    m = model(lambda g, x, am: attention(g, x, am, fill=-math.inf))  # the original: NaN on padded rows
    assert "gives NaN here" in refusal(m)


def test_refuses_double():
    m = model(lambda g, x, am: attention(g, x, am), dtype=TensorProto.DOUBLE)
    assert "DOUBLE" in refusal(m)


def test_refuses_when_the_probabilities_are_read_elsewhere():
    def leaky(g, x, am):
        y = attention(g, x, am)
        probs = next(n for n in g.nodes if n.op_type == "Softmax").output[0]
        weight = g.op("ReduceSum", probs, g.ints(1, 3), keepdims=0)  # [B, Sq]: e.g. an attention rollout
        return g.op("Add", y, g.op("Unsqueeze", weight, g.ints(2)))

    m = model(leaky)
    assert "also used outside" in refusal(m)
    assert_same(m, graph_rewrites.optimize(m))


def test_refuses_a_reshape_that_is_not_a_head_split():
    def swapped(g, x):  # Q reshaped to [S, B, N, D]: rows of one sequence become rows of the batch
        return g.op("Concat", g.op("Shape", x, start=1, end=2), g.op("Shape", x, start=0, end=1), g.ints(N, D),
                    axis=0)

    m = model(lambda g, x, am: attention(g, x, am, q_shape=swapped))
    assert "not provably a head split" in refusal(m)


def test_optimizing_twice_is_the_same_as_once():
    m = model(lambda g, x, am: attention(g, x, am))
    once = graph_rewrites.optimize(m)
    twice, rep = graph_rewrites.optimize(once, report=True)
    assert rep.fused() == 0
    assert graph_rewrites.op_counts(twice) == graph_rewrites.op_counts(once)
    assert_same(m, twice)
