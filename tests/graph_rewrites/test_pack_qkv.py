"""pack_qkv on hand-built self-attention (the builders of test_attention_rules.py): the three projections
become one MatMul over [Wq | Wk | Wv] and PackedMultiHeadAttention, with the original's outputs on ORT CPU;
and what it must leave as MultiHeadAttention: cross-attention, a weight that is not a constant, a projection
whose sum is read elsewhere."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import graph_rewrites
from tests.graph_rewrites.test_attention_rules import H, _feeds, assert_same, attention, model

PACKED, MHA = "ai.ort_triton.PackedMultiHeadAttention", "ai.ort_triton.MultiHeadAttention"


def with_projections(*makers, **kw):
    """attention(**kw) whose Q, K, V projections (in that order) come from makers[i](g, x) (None: g.linear)."""
    def build(g, x, am):
        linear, calls = g.linear, iter(makers)
        g.linear = lambda x_: (next(calls, None) or (lambda g_, v: linear(v)))(g, x_)
        return attention(g, x, am, **kw)
    return build


def bare(g, x):  # a projection without bias
    return g.op("MatMul", x, g.const(g.rng.normal(0, 0.3, (H, H)), hint="w"))


@pytest.mark.parametrize("biases", ["qkv", "", "kv", "q", "k", "v", "qv"])
def test_packs_the_three_projections(biases):
    """Every mix of biased and bare projections (a K or V bias alone is folded by attention_bias_one): the
    missing biases are zeros in the packed bias."""
    m = model(with_projections(*(None if p in biases else bare for p in "qkv")))
    out, rep = graph_rewrites.optimize(m, report=True)
    st = rep.rules["pack_qkv"]
    assert st.matched == 1 and not st.refused, st
    counts = graph_rewrites.op_counts(out)
    assert counts[PACKED] == 1 and counts[MHA] == 0 and counts["MatMul"] == 1, counts
    assert counts["Add"] == 0, counts  # every projection bias went into the op
    (w,) = [i for i in out.graph.initializer if i.name.endswith("__ot_qkv")]
    assert list(w.dims) == [H, 3 * H]
    assert_same(m, out)


def test_packed_weight_is_the_three_side_by_side():
    m = model(with_projections())
    out = graph_rewrites.optimize(m)
    weights = [onnx.numpy_helper.to_array(i) for i in m.graph.initializer if list(i.dims) == [H, H]]
    (packed,) = [onnx.numpy_helper.to_array(i) for i in out.graph.initializer if i.name.endswith("__ot_qkv")]
    np.testing.assert_array_equal(packed, np.concatenate(weights[:3], axis=1))


def test_float16():
    m = model(with_projections(fill=float(np.finfo(np.float16).min)), dtype=TensorProto.FLOAT16)
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.rules["pack_qkv"].matched == 1, rep.rules
    (w,) = [i for i in out.graph.initializer if i.name.endswith("__ot_qkv")]
    assert w.data_type == TensorProto.FLOAT16


def test_cross_attention_stays_unpacked():
    """K and V projections of another input (an encoder's states): no one x to pack over."""
    def other(g, _x):
        return g.linear("memory")

    mem = helper.make_tensor_value_info("memory", TensorProto.FLOAT, ["batch", "seq", H])
    m = model(with_projections(None, other, other), extra_inputs=[mem])
    out, rep = graph_rewrites.optimize(m, report=True)
    assert rep.rules["attention"].matched == 1 and rep.rules["pack_qkv"].matched == 0
    assert graph_rewrites.op_counts(out)[MHA] == 1
    assert_same(m, out)


def test_weight_that_is_not_a_constant_is_refused_with_the_reason():
    def runtime_weight(g, x):  # with a bias, as K's: attention_bias folds the two together
        return g.op("Add", g.op("MatMul", x, "wv"), g.const(g.rng.normal(0, 0.1, H), hint="b"))

    wv = helper.make_tensor_value_info("wv", TensorProto.FLOAT, [H, H])
    m = model(with_projections(None, None, runtime_weight), extra_inputs=[wv])
    out, rep = graph_rewrites.optimize(m, report=True)
    st = rep.rules["pack_qkv"]
    assert st.matched == 0 and any("weight wv is not a constant" in r.reason for r in st.refused), st
    assert graph_rewrites.op_counts(out)[MHA] == 1


def test_projection_read_elsewhere_stays_unpacked():
    """Q's projection is also a graph output: its MatMul must stay, so packing would compute it twice."""
    m = model(with_projections(bare))
    q_proj = next(n for n in m.graph.node if n.op_type == "MatMul").output[0]
    m.graph.output.append(helper.make_tensor_value_info(q_proj, TensorProto.FLOAT, ["batch", "seq", H]))
    out, rep = graph_rewrites.optimize(m, report=True)
    st = rep.rules["pack_qkv"]
    assert st.matched == 0 and graph_rewrites.op_counts(out)[MHA] == 1, st
    assert any("is also read outside the attention" in r.reason for r in st.refused), st
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = _feeds(m, 3, 6, 0)
    for a, b in zip(ref.run(None, feeds), new.run(None, feeds)):
        assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


def test_optimizing_twice_is_the_same_as_once():
    m = model(with_projections())
    once = graph_rewrites.optimize(m)
    twice, rep = graph_rewrites.optimize(once, report=True)
    assert rep.fused() == 0 and graph_rewrites.op_counts(twice) == graph_rewrites.op_counts(once)
    assert_same(m, twice)
