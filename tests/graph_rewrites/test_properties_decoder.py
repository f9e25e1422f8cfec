"""Property tests (hypothesis) for the decoder rules: generated RMSNorm (+ residual), SwiGLU and rotary
variants are either fused and give the original's outputs (ORT CPU, function bodies), or left alone with
a reason. Never a changed result.

Variants: hidden sizes 1..64, batch ranks 1-3; RMSNorm with Pow or Mul for the square, Reciprocal or
Div(1, .) or Div(x, .), the weight on either side, an optional no-op Cast pair, a residual Add that is
equal-shaped or broadcasting, its sum read again or not, the mean square also read elsewhere (must not
fuse), two norms sharing a weight; SiluMul with either operand order and Sigmoid(g) read elsewhere (must
not fuse); rotary on [B, N, S, D] with cos/sin [B or 1, 1, S, D], either Add order; ONNX RMSNormalization
(opset 23) with the same residual forms, and over another axis or with stash_type 0 (refused).
"""

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
n = helper.make_node


def _c(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _model(nodes, inputs, outputs, inits, opset=18):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _run(model, feeds):
    # ORT's own fusions off: at ORT_ENABLE_EXTENDED, ORT 1.31 turns a rank-1 RMSNorm ([1] input, Div(1, .))
    # into an invalid graph ("Node input ... is not ... output of a previous node") before anything runs
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _same(model, out, feeds):
    run = lambda m: _run(m, feeds)  # noqa: E731
    for a, b in zip(run(model), run(out)):
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= 1e-5 * max(np.abs(a).max(), 1e-6) + 1e-6


def _refusals(rep) -> list[str]:
    return [r.reason for s in rep.rules.values() for r in s.refused]


def _residual_add(rng, residual, h, inits, inputs, nodes) -> str:
    """s = x + r in front of a norm (r an [H] initializer when `residual` is "broadcast", else an input of x's
    shape); returns the norm's input ("x" when `residual` is "none")."""
    if residual == "none":
        return "x"
    if residual == "broadcast":
        inits.append(_c("r", rng.normal(size=h)))
    else:
        inputs.append("r")
    nodes.append(n("Add", ["x", "r"], ["s"]))
    return "s"


@st.composite
def rms_graphs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    h = draw(st.integers(1, 64))
    shape = [*draw(st.lists(st.integers(1, 4), min_size=0, max_size=2)), h]
    square = draw(st.sampled_from(["pow", "mul"]))
    inv = draw(st.sampled_from(["reciprocal", "div_one", "div_x"]))
    weight_first, casts = draw(st.booleans()), draw(st.booleans())
    residual = draw(st.sampled_from(["none", "post", "pre", "broadcast"]))
    leak = draw(st.booleans())  # the mean square is also a graph output: the norm must stay unfused
    second = draw(st.booleans())  # a second norm sharing the weight
    inits = [_c("w", rng.normal(1, 0.3, h)), _c("eps", 1e-6), _c("two", 2.0), _c("one", 1.0)]
    inputs, nodes, outputs = ["x"], [], []
    src = _residual_add(rng, residual, h, inits, inputs, nodes)

    def norm(x, y, tag):
        out, xin = [], x
        if casts:
            out.append(n("Cast", [x], [f"{tag}xf"], to=TensorProto.FLOAT))
            xin = f"{tag}xf"
        out.append(n("Pow", [xin, "two"], [f"{tag}sq"]) if square == "pow" else n("Mul", [xin, xin], [f"{tag}sq"]))
        out += [n("ReduceMean", [f"{tag}sq", "axes"], [f"{tag}ms"], keepdims=1),
                n("Add", [f"{tag}ms", "eps"], [f"{tag}v"]), n("Sqrt", [f"{tag}v"], [f"{tag}sd"])]
        if inv == "div_x":
            out.append(n("Div", [xin, f"{tag}sd"], [f"{tag}nx"]))
        else:
            out.append(n("Reciprocal", [f"{tag}sd"], [f"{tag}r"]) if inv == "reciprocal"
                       else n("Div", ["one", f"{tag}sd"], [f"{tag}r"]))
            out.append(n("Mul", [xin, f"{tag}r"], [f"{tag}nx"]))
        nx = f"{tag}nx"
        if casts:
            out.append(n("Cast", [nx], [f"{tag}nb"], to=TensorProto.FLOAT))
            nx = f"{tag}nb"
        out.append(n("Mul", ["w", nx] if weight_first else [nx, "w"], [y]))
        return out

    inits.append(_c("axes", [-1], np.int64))
    nodes += norm(src, "y", "a")
    outputs.append("y")
    if residual == "pre":
        nodes.append(n("Mul", ["s", "s"], ["next"]))
        outputs.append("next")
    if leak:
        outputs.append("ams")
    if second:
        nodes += norm("x", "y2", "b")
        outputs.append("y2")
    out_shape = lambda o: [*shape[:-1], 1] if o == "ams" else shape  # noqa: E731
    model = _model(nodes, [_vi(i, shape) for i in inputs], [_vi(o, out_shape(o)) for o in outputs], inits)
    feeds = {i: rng.normal(0.3, 2.0, shape).astype(np.float32) for i in inputs}
    if residual == "broadcast" and len(shape) == 1:
        residual = "post"  # x [H] + r [H]: the same shape, a residual after all
    return model, feeds, residual, leak, second


@SETTINGS
@given(rms_graphs())
def test_rms_norm_variants_fuse_or_refuse_never_change(case):
    model, feeds, residual, leak, second = case
    out, rep = graph_rewrites.optimize(model, report=True)
    _same(model, out, feeds)
    after = rep.ops_after
    fused = after["ai.ort_triton.RMSNorm"] + after["ai.ort_triton.AddRMSNorm"]
    # the leaked mean square keeps the first norm's subgraph; every other norm is one the rules claim
    assert fused == (0 if leak else 1) + int(second), (dict(after), _refusals(rep))
    if leak:
        assert any("used outside" in r or "other uses" in r for r in _refusals(rep)), _refusals(rep)
    if residual in ("post", "pre") and not leak:
        assert after["ai.ort_triton.AddRMSNorm"] == 1, dict(after)
    if residual == "broadcast" and not leak:
        assert after["ai.ort_triton.AddRMSNorm"] == 0 and after["Add"] == 1, dict(after)


@st.composite
def silu_graphs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    i = draw(st.integers(1, 64))
    shape = [*draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)), i]
    order = draw(st.permutations([0, 1]))
    gate_first = draw(st.booleans())
    leak = draw(st.booleans())  # Sigmoid(g) also a graph output
    sig = n("Sigmoid", ["g"], ["sg"])
    silu = n("Mul", ["g", "sg"] if gate_first else ["sg", "g"], ["silu"])
    prod = n("Mul", [["silu", "u"][k] for k in order], ["y"])
    outputs = ["y"] + (["sg"] if leak else [])
    model = _model([sig, silu, prod], [_vi("g", shape), _vi("u", shape)], [_vi(o, shape) for o in outputs], [])
    feeds = {k: rng.normal(0, 3, shape).astype(np.float32) for k in ("g", "u")}
    return model, feeds, leak


@SETTINGS
@given(silu_graphs())
def test_silu_mul_variants_fuse_or_refuse_never_change(case):
    model, feeds, leak = case
    out, rep = graph_rewrites.optimize(model, report=True)
    _same(model, out, feeds)
    assert rep.ops_after["ai.ort_triton.SiluMul"] == (0 if leak else 1), (dict(rep.ops_after), _refusals(rep))


@st.composite
def rotary_graphs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    b, heads, s = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 9))
    d = 2 * draw(st.integers(1, 24))
    cos_batch = draw(st.sampled_from([1, b]))
    add_swap, mul_swap = draw(st.booleans()), draw(st.booleans())
    half = d // 2
    inits = [_c("st0", [0], np.int64), _c("en0", [half], np.int64), _c("st1", [half], np.int64),
             _c("en1", [2**62], np.int64), _c("ax", [3], np.int64)]
    nodes = [n("Slice", ["x", "st0", "en0", "ax"], ["x1"]), n("Slice", ["x", "st1", "en1", "ax"], ["x2"]),
             n("Neg", ["x2"], ["nx2"]), n("Concat", ["nx2", "x1"], ["rot"], axis=-1),
             n("Mul", ["cos", "x"] if mul_swap else ["x", "cos"], ["xc"]),
             n("Mul", ["sin", "rot"] if mul_swap else ["rot", "sin"], ["rs"]),
             n("Add", ["rs", "xc"] if add_swap else ["xc", "rs"], ["y"])]
    x_shape, cs_shape = [b, heads, s, d], [cos_batch, 1, s, d]
    model = _model(nodes, [_vi("x", x_shape), _vi("cos", cs_shape), _vi("sin", cs_shape)], [_vi("y", x_shape)],
                   inits)
    angle = rng.uniform(0, 6.3, (cos_batch, 1, s, half))
    angle = np.concatenate([angle, angle], axis=-1)
    feeds = {"x": rng.normal(0, 1, x_shape).astype(np.float32), "cos": np.cos(angle).astype(np.float32),
             "sin": np.sin(angle).astype(np.float32)}
    return model, feeds


@SETTINGS
@given(rotary_graphs())
def test_rotary_variants_fuse_and_keep_results(case):
    model, feeds = case
    out, rep = graph_rewrites.optimize(model, report=True)
    _same(model, out, feeds)
    assert rep.ops_after["ai.ort_triton.Rotary"] == 1, (dict(rep.ops_after), _refusals(rep))


# ---- ONNX RMSNormalization (opset 23), with the residual Add --------------------------------------------
@st.composite
def rms_op_graphs(draw, defect="none"):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    h = draw(st.integers(1, 64))
    shape = [*draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)), h]
    residual = draw(st.sampled_from(["none", "post", "keep_sum", "broadcast"]))
    attrs = dict(epsilon=draw(st.sampled_from([1e-6, 1e-5, 0.1])))
    scale_shape = [h]
    if defect == "axis":
        attrs["axis"] = len(shape) - 2
        scale_shape = shape[-2:]
    elif defect == "stash_type":
        attrs["stash_type"] = 0
    inits, inputs, nodes, outputs = [_c("scale", rng.normal(1, 0.3, scale_shape))], ["x"], [], ["y"]
    src = _residual_add(rng, residual, h, inits, inputs, nodes)
    if residual == "keep_sum":
        outputs.append("s")
    nodes.append(n("RMSNormalization", [src, "scale"], ["y"], **attrs))
    model = _model(nodes, [_vi(i, shape) for i in inputs], [_vi(o, None) for o in outputs], inits,
                   opset=23)
    feeds = {i: rng.normal(0.3, 2.0, shape).astype(np.float32) for i in inputs}
    return model, feeds, residual  # x is at least 2-D: an [H] r broadcasts, never a residual of x's shape


@SETTINGS
@given(rms_op_graphs())
def test_rms_normalization_op_fuses_and_keeps_results(case):
    model, feeds, residual = case
    event(f"residual: {residual}")
    out, rep = graph_rewrites.optimize(model, report=True)
    _same(model, out, feeds)
    after = rep.ops_after
    assert after["RMSNormalization"] == 0 and rep.rules["rms_norm"].matched == 1, dict(after)
    folded = residual in ("post", "keep_sum")
    assert after["ai.ort_triton.AddRMSNorm"] == folded and after["Add"] == (residual == "broadcast"), dict(after)


@pytest.mark.parametrize("defect, reason", [("axis", "not the last axis"), ("stash_type", "stash_type")])
@settings(SETTINGS, max_examples=6)
@given(data=st.data())
def test_rms_normalization_op_defects_are_refused(defect, reason, data):
    model, feeds, _ = data.draw(rms_op_graphs(defect), label="case")
    out, rep = graph_rewrites.optimize(model, report=True)
    _same(model, out, feeds)
    assert rep.ops_after["RMSNormalization"] == 1 and any(reason in r for r in _refusals(rep))
