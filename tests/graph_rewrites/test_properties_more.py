"""Property tests (hypothesis) for the rules the other property files leave out: ONNX's own RotaryEmbedding
(opset 23) and Swish (24), the partial rotary (Phi, GPT-NeoX) and the MatMul bias folded into AddLayerNorm
(bias_add_layer_norm); ONNX RMSNormalization is in test_properties_decoder.py. Each generated graph is either
fused and gives the original's outputs (ORT CPU, function bodies), or left alone with the reason in the
report. Never a changed result.

Variants: head sizes from 2 and hidden sizes from 1, batch ranks; rotary interleaved or half-split, full or
partial, cos/sin per batch or shared; Swish's alpha and the product's operand order; the bias Add's and the
residual Add's operand orders, LayerNormalization or its decomposition, the sum kept, the bias an initializer
or a graph input. Defects, each refused with its reason: RotaryEmbedding with position_ids, Swish with
alpha != 1, a partial rotary whose pass-through leaves a gap, a [1, H] bias row.
"""

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEFECTS = settings(SETTINGS, max_examples=6)
n = helper.make_node
INT_MAX = np.iinfo(np.int64).max


def _c(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _vi(name, shape, t=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, t, shape)


def _model(nodes, inputs, outputs, inits, opset):
    g = helper.make_graph(nodes, "g", inputs, [_vi(o, None) for o in outputs], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _run(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _optimize_same(model, feeds):
    """The rewritten model and report; its outputs equal the original's."""
    out, rep = graph_rewrites.optimize(model, report=True)
    for a, b in zip(_run(model, feeds), _run(out, feeds), strict=True):
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= 1e-5 * max(np.abs(a).max(), 1e-6) + 1e-6
    return out, rep


def _reasons(rep, rule):
    return [r.reason for r in rep.rules[rule].refused]


# ---- ONNX RotaryEmbedding (opset 23) ---------------------------------------------------------------------
@st.composite
def rotary_op_graphs(draw, defect="none"):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    b, heads, s = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 9))
    d = 2 * draw(st.integers(1, 32))
    r = 2 * draw(st.integers(1, d // 2)) if draw(st.booleans()) else 0  # 0: the whole head
    interleaved = draw(st.integers(0, 1))
    half = (r or d) // 2
    inputs = [_vi("x", [b, heads, s, d]), _vi("cos", [b, s, half]), _vi("sin", [b, s, half])]
    names = ["x", "cos", "sin"]
    angle = rng.uniform(0, 6.3, (b, s, half))
    feeds = {"x": rng.normal(size=(b, heads, s, d)).astype(np.float32), "cos": np.cos(angle).astype(np.float32),
             "sin": np.sin(angle).astype(np.float32)}
    if defect == "position_ids":  # then cos/sin are tables over positions
        names.append("pos")
        inputs[1:] = [_vi("cos", [16, half]), _vi("sin", [16, half]), _vi("pos", [b, s], TensorProto.INT64)]
        table = rng.uniform(0, 6.3, (16, half))
        feeds.update(cos=np.cos(table).astype(np.float32), sin=np.sin(table).astype(np.float32),
                     pos=rng.integers(0, 16, (b, s)).astype(np.int64))
    node = n("RotaryEmbedding", names, ["y"], interleaved=interleaved, rotary_embedding_dim=r)
    return _model([node], inputs, ["y"], [], opset=23), feeds


@SETTINGS
@given(rotary_op_graphs())
def test_rotary_embedding_op_fuses_and_keeps_results(case):
    model, feeds = case
    _, rep = _optimize_same(model, feeds)
    assert rep.ops_after["ai.ort_triton.Rotary"] == 1 and rep.ops_after["RotaryEmbedding"] == 0, dict(rep.ops_after)


# An odd rotary_embedding_dim is refused too (test_rotary_rules.py), but ORT CPU runs that original over memory
# it does not own (values like 5e25 that change from run to run), so it has no result to compare here.
@DEFECTS
@given(rotary_op_graphs("position_ids"))
def test_rotary_embedding_op_with_position_ids_is_refused(case):
    _, rep = _optimize_same(*case)
    assert rep.ops_after["RotaryEmbedding"] == 1
    assert any("position_ids is given" in r for r in _reasons(rep, "rotary_onnx"))


# ---- ONNX Swish (opset 24) times the up projection -------------------------------------------------------
@st.composite
def swish_graphs(draw, defect="none"):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    shape = [*draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)), draw(st.integers(1, 64))]
    alpha = draw(st.sampled_from([0.5, 1.702, 2.0])) if defect == "alpha" else 1.0
    nodes = [n("Swish", ["g"], ["sg"], alpha=alpha),
             n("Mul", ["sg", "u"] if draw(st.booleans()) else ["u", "sg"], ["y"])]
    model = _model(nodes, [_vi("g", shape), _vi("u", shape)], ["y"], [], opset=24)
    return model, {k: rng.normal(0, 3, shape).astype(np.float32) for k in ("g", "u")}


@SETTINGS
@given(swish_graphs())
def test_swish_mul_fuses_and_keeps_results(case):
    _, rep = _optimize_same(*case)
    assert rep.ops_after["ai.ort_triton.SiluMul"] == 1 and rep.ops_after["Swish"] == 0, dict(rep.ops_after)


@DEFECTS
@given(swish_graphs("alpha"))
def test_swish_with_another_alpha_is_refused(case):
    _, rep = _optimize_same(*case)
    assert rep.ops_after["Swish"] == 1 and any("is not silu" in r for r in _reasons(rep, "swish_mul"))


# ---- the partial rotary: cat(rotate_half rotary of x[..., :R], x[..., R:]) ---------------------------------
@st.composite
def partial_rotary_graphs(draw, defect="none"):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    b, heads, s = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 9))
    half = draw(st.integers(1, 16))
    r = 2 * half
    d = r + draw(st.integers(1, 16))
    gap = draw(st.integers(1, d - r)) if defect == "gap" and d - r > 1 else 0
    if defect == "gap" and not gap:
        d, gap = d + 2, 1
    ints = lambda name, *v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    inits = [ints("z", 0), ints("r", r), ints("rg", r + gap), ints("mx", INT_MAX), ints("ax", -1), ints("h", half)]
    cos_batch = draw(st.sampled_from([1, b]))
    nodes = [n("Slice", ["x", "z", "r", "ax"], ["xr"]), n("Slice", ["x", "rg", "mx", "ax"], ["xp"]),
             n("Slice", ["xr", "z", "h", "ax"], ["x1"]), n("Slice", ["xr", "h", "mx", "ax"], ["x2"]),
             n("Neg", ["x2"], ["nx2"]), n("Concat", ["nx2", "x1"], ["rot"], axis=-1),
             n("Mul", ["xr", "cos"], ["xc"]), n("Mul", ["rot", "sin"], ["rs"]),
             n("Add", ["xc", "rs"] if draw(st.booleans()) else ["rs", "xc"], ["emb"]),
             n("Concat", ["emb", "xp"], ["y"], axis=-1)]
    cs = [cos_batch, 1, s, r]
    model = _model(nodes, [_vi("x", [b, heads, s, d]), _vi("cos", cs), _vi("sin", cs)], ["y"], inits, opset=18)
    angle = rng.uniform(0, 6.3, (cos_batch, 1, s, half))
    angle = np.concatenate([angle, angle], axis=-1)
    feeds = {"x": rng.normal(size=(b, heads, s, d)).astype(np.float32), "cos": np.cos(angle).astype(np.float32),
             "sin": np.sin(angle).astype(np.float32)}
    return model, feeds


@SETTINGS
@given(partial_rotary_graphs())
def test_partial_rotary_fuses_into_one_op(case):
    _, rep = _optimize_same(*case)
    after = rep.ops_after
    assert rep.rules["rotary_partial"].matched == 1 and after["ai.ort_triton.Rotary"] == 1, dict(after)
    assert not after["Concat"] and not after["Slice"], dict(after)


@DEFECTS
@given(partial_rotary_graphs("gap"))
def test_partial_rotary_with_a_gap_is_refused(case):
    _, rep = _optimize_same(*case)
    assert rep.ops_after["ai.ort_triton.Rotary"] == 1 and rep.ops_after["Concat"] == 1  # the inner one only
    assert any("not a partial rotary" in r for r in _reasons(rep, "rotary_partial"))


# ---- the MatMul bias folded into AddLayerNorm -------------------------------------------------------------
@st.composite
def bias_residual_graphs(draw, defect="none"):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    h, k = draw(st.integers(1, 48)), draw(st.integers(1, 24))
    lead = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    keep_sum, decomposed = draw(st.booleans()), draw(st.booleans())
    inits = [_c("w", rng.normal(0, k ** -0.5, (k, h))), _c("g", rng.normal(1, 0.3, h)),
             _c("beta", rng.normal(0, 0.3, h)), _c("eps", 1e-5)]
    inputs = [_vi("x", [*lead, k]), _vi("r", [*lead, h])]
    if defect == "bias_input":  # a graph input is still a bias
        inputs.append(_vi("c", [h]))
    else:  # a [1, H] row is not: it broadcasts, but the op's bias is [H]
        inits.append(_c("c", rng.normal(0, 0.5, [1, h] if defect == "bias_row" else [h])))
    nodes = [n("MatMul", ["x", "w"], ["m"]),
             n("Add", ["m", "c"] if draw(st.booleans()) else ["c", "m"], ["mb"]),
             n("Add", ["mb", "r"] if draw(st.booleans()) else ["r", "mb"], ["s"])]
    if decomposed:
        nodes += [n("ReduceMean", ["s"], ["mean"], axes=[-1]), n("Sub", ["s", "mean"], ["d"]),
                  n("Mul", ["d", "d"], ["dd"]), n("ReduceMean", ["dd"], ["var"], axes=[-1]),
                  n("Add", ["var", "eps"], ["ve"]), n("Sqrt", ["ve"], ["sd"]), n("Div", ["d", "sd"], ["nd"]),
                  n("Mul", ["nd", "g"], ["gn"]), n("Add", ["gn", "beta"], ["y"])]
    else:
        nodes.append(n("LayerNormalization", ["s", "g", "beta"], ["y"], axis=-1, epsilon=1e-5))
    model = _model(nodes, inputs, ["y"] + (["s"] if keep_sum else []), inits, opset=17)
    feeds = {"x": rng.normal(size=(*lead, k)).astype(np.float32), "r": rng.normal(size=(*lead, h)).astype(np.float32)}
    if defect == "bias_input":
        feeds["c"] = rng.normal(size=h).astype(np.float32)
    return model, feeds


@pytest.mark.parametrize("form", ["none", "bias_input"])
@SETTINGS
@given(data=st.data())
def test_matmul_bias_folds_into_add_layer_norm(form, data):
    _, rep = _optimize_same(*data.draw(bias_residual_graphs(form), label="case"))
    after = rep.ops_after
    assert after["ai.ort_triton.AddLayerNorm"] == 1 and not after["Add"], dict(after)
    assert rep.rules["bias_add_layer_norm"].matched == 1, rep.rules["bias_add_layer_norm"]


@DEFECTS
@given(bias_residual_graphs("bias_row"))
def test_a_bias_row_stays_an_add(case):
    _, rep = _optimize_same(*case)
    assert rep.ops_after["ai.ort_triton.AddLayerNorm"] == 1 and rep.ops_after["Add"] == 1, dict(rep.ops_after)
    assert any("bias" in r for r in _reasons(rep, "bias_add_layer_norm")), rep.rules["bias_add_layer_norm"]
