"""RMSNorm rules on hand-built graphs (every form they claim, and the forms they must refuse, with the
reason) and on real Llama / Mistral / Qwen2 exports by both torch exporters.

Each fused case must give the original's outputs on ORT CPU (through the function bodies); each refused
case must be left alone, with the reason in the report.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from ort_triton.contract import DOMAIN
from ort_triton.ops.rms_norm import ADD_RMS_NORM, RMS_NORM

RNG = np.random.default_rng(0)
H = 48
RULES = ["rms_norm", "rms_norm_decomposed", "add_rms_norm", "add_rms_norm_keep_sum"]


def _init(name, arr, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(arr, dtype), name)


def _model(nodes, inputs, outputs, inits, opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _vi(name, shape, t=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, t, shape)


def _decomposed(x, out, h, *, pow_form=True, inv="reciprocal", axes_input=False, weight_first=True,
                cast_in=False, cast_out=False, to=TensorProto.FLOAT, back=TensorProto.FLOAT, eps=1e-6,
                axes=(-1,), two=2.0, weight_shape=None, np_type=np.float32, prefix="rms"):
    """HF's LlamaRMSNorm the way the exporters write it, in several spellings."""
    p = lambda s: f"{prefix}_{s}"
    n = helper.make_node
    nodes = []
    inits = [_init(p("w"), RNG.normal(1, 0.2, weight_shape or h), np_type), _init(p("eps"), eps),
             _init(p("two"), two), _init(p("one"), 1.0)]
    xf = x
    if cast_in:
        nodes.append(n("Cast", [x], [p("xf")], to=to))
        xf = p("xf")
    nodes.append(n("Pow", [xf, p("two")], [p("sq")]) if pow_form else n("Mul", [xf, xf], [p("sq")]))
    if axes_input:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), p("axes")))
        nodes.append(n("ReduceMean", [p("sq"), p("axes")], [p("ms")], keepdims=1))
    else:
        nodes.append(n("ReduceMean", [p("sq")], [p("ms")], axes=list(axes), keepdims=1))
    nodes += [n("Add", [p("ms"), p("eps")], [p("mse")]), n("Sqrt", [p("mse")], [p("std")])]
    if inv == "reciprocal":
        nodes += [n("Reciprocal", [p("std")], [p("inv")]), n("Mul", [xf, p("inv")], [p("normed")])]
    elif inv == "div_one":
        nodes += [n("Div", [p("one"), p("std")], [p("inv")]), n("Mul", [p("inv"), xf], [p("normed")])]
    else:
        nodes.append(n("Div", [xf, p("std")], [p("normed")]))
    normed = p("normed")
    if cast_out:
        nodes.append(n("Cast", [normed], [p("back")], to=back))
        normed = p("back")
    nodes.append(n("Mul", [p("w"), normed] if weight_first else [normed, p("w")], [out]))
    return nodes, inits


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _assert_same(original, optimized, feeds, rtol=1e-5):
    for a, b in zip(_run(original, feeds), _run(optimized, feeds)):
        assert a.shape == b.shape
        err = np.abs(a.astype(np.float64) - b).max() / np.abs(a).max()
        assert err < rtol, f"rel err {err:.2e}"


def _feeds(*names, shape=(2, 5, H), dtype=np.float32):
    return {n: RNG.normal(0.5, 2.0, shape).astype(dtype) for n in names}


def _fused(report):
    return {k: v.matched for k, v in report.rules.items() if v.matched}


def _refusal(rep, rule):
    st = rep.rules[rule]
    assert st.matched == 0 and st.refused, st
    return " | ".join(r.reason for r in st.refused)


def _optimize(m):
    return graph_rewrites.optimize(m, report=True, only=RULES)


# ---- the function bodies ------------------------------------------------------------------------------
def _single_node_model(op, inputs, attrs, opset, elem=TensorProto.FLOAT):
    names = [f"in{i}" for i in range(len(inputs))]
    outs = [f"out{i}" for i in range(len(op.outputs))]
    node = helper.make_node(op.name, names, outs, domain=DOMAIN, **attrs)
    g = helper.make_graph([node], op.name, [_vi(nm, a.shape, elem) for nm, a in zip(names, inputs)],
                          [_vi(o, inputs[0].shape, elem) for o in outs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
                             functions=[op.function_proto(opset)], ir_version=10)


@pytest.mark.parametrize("opset", [15, 16, 17, 18, 20, 23])
@pytest.mark.parametrize("op", [RMS_NORM, ADD_RMS_NORM], ids=lambda op: op.name)
def test_body_equals_reference_at_every_opset(op, opset):
    x = RNG.normal(1.0, 2.0, (2, 5, 24)).astype(np.float32)
    inputs = [x, RNG.normal(size=x.shape).astype(np.float32)] if op is ADD_RMS_NORM else [x]
    inputs.append(RNG.normal(1, 0.3, 24).astype(np.float32))
    m = _single_node_model(op, inputs, {"epsilon": 1e-3}, opset)
    onnx.checker.check_model(m)
    got = _run(m, {f"in{i}": a for i, a in enumerate(inputs)})
    want = op.reference(*inputs, epsilon=1e-3)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert np.abs(g - w).max() / np.abs(w).max() < 1e-5


def test_fp16_body_rounds_once_and_does_not_overflow():
    """In float16 the body normalises in fp32 and rounds once: inputs near fp16's max (whose squares are
    inf in fp16) give the float64 reference to fp16 precision."""
    x = (RNG.uniform(-1, 1, (3, 40)) * 6.5e4).astype(np.float16)
    gamma = RNG.normal(1, 0.3, 40).astype(np.float16)
    (y,) = _run(_single_node_model(RMS_NORM, [x, gamma], {"epsilon": 1e-6}, 18, TensorProto.FLOAT16),
                {"in0": x, "in1": gamma})
    (want,) = RMS_NORM.reference(x, gamma, 1e-6)
    assert np.isfinite(y).all()
    assert np.abs(y - want).max() <= np.abs(want).max() * 2 ** -10  # within an fp16 ulp of the largest


# ---- the decomposed form ------------------------------------------------------------------------------
@pytest.mark.parametrize("pow_form", [True, False])
@pytest.mark.parametrize("inv", ["reciprocal", "div_one", "div"])
@pytest.mark.parametrize("axes_input", [True, False])
def test_decomposed(pow_form, inv, axes_input):
    nodes, inits = _decomposed("x", "y", H, pow_form=pow_form, inv=inv, axes_input=axes_input,
                               weight_first=pow_form)
    m = _model(nodes, [_vi("x", ["batch", "seq", H])], [_vi("y", ["batch", "seq", H])], inits,
               opset=18 if axes_input else 15)
    out, rep = _optimize(m)
    assert _fused(rep) == {"rms_norm_decomposed": 1}, rep.rules["rms_norm_decomposed"]
    assert graph_rewrites.op_counts(out) == {"ai.ort_triton.RMSNorm": 1}
    (node,) = out.graph.node
    assert list(node.input) == ["x", "rms_w"]
    assert next(a.f for a in node.attribute if a.name == "epsilon") == pytest.approx(1e-6)  # read from the graph
    _assert_same(m, out, _feeds("x"))


@pytest.mark.parametrize("cast_in, cast_out", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("axes_input", [True, False])
def test_no_op_casts_in_an_fp32_model(cast_in, cast_out, axes_input):
    """The TorchScript export keeps LlamaRMSNorm's Casts to float even in an fp32 model."""
    nodes, inits = _decomposed("x", "y", H, cast_in=cast_in, cast_out=cast_out, inv="div_one",
                               axes_input=axes_input)
    m = _model(nodes, [_vi("x", [2, 5, H])], [_vi("y", [2, 5, H])], inits, opset=18 if axes_input else 17)
    out, rep = _optimize(m)
    assert _fused(rep) == {"rms_norm_decomposed": 1}, rep.rules["rms_norm_decomposed"]
    assert graph_rewrites.op_counts(out) == {"ai.ort_triton.RMSNorm": 1}
    _assert_same(m, out, _feeds("x"))


def test_escaping_no_op_cast_stays_and_the_norm_starts_after_it():
    """fp32 TorchScript: the first Cast's output is also the residual; the Cast stays, the norm reads it."""
    nodes, inits = _decomposed("x", "y", H, cast_in=True, cast_out=True, inv="div_one")
    nodes.append(helper.make_node("Add", ["rms_xf", "y"], ["z"]))
    m = _model(nodes, [_vi("x", [2, 5, H])], [_vi("z", [2, 5, H])], inits)
    out, rep = _optimize(m)
    assert graph_rewrites.op_counts(out) == {"Cast": 1, "ai.ort_triton.RMSNorm": 1, "Add": 1}
    _assert_same(m, out, _feeds("x"))


@pytest.mark.parametrize("elem", [TensorProto.FLOAT16, TensorProto.BFLOAT16], ids=["float16", "bfloat16"])
def test_16_bit_model_with_real_casts(elem):
    """x fp16/bf16 -> Cast(float) -> ... -> Cast(back) -> * weight: the norm of a 16-bit model. numpy has
    no bfloat16, so the graph takes fp32 in and out and casts at the edges."""
    nodes, inits = _decomposed("x", "y", H, cast_in=True, cast_out=True, back=elem)
    inits[0].name = "rms_w32"
    nodes[:0] = [helper.make_node("Cast", ["x32"], ["x"], to=elem), helper.make_node("Cast", ["rms_w32"], ["rms_w"],
                                                                                       to=elem)]
    nodes.append(helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT))
    m = _model(nodes, [_vi("x32", [2, 5, H])], [_vi("y32", [2, 5, H])], inits)
    out, rep = _optimize(m)
    assert _fused(rep) == {"rms_norm_decomposed": 1}, rep.rules["rms_norm_decomposed"]
    node = next(n for n in out.graph.node if n.op_type == "RMSNorm")
    assert list(node.input) == ["x", "rms_w"]  # the Casts to float and back are inside the fused node
    feeds = _feeds("x32")
    (got,) = _run(out, feeds)
    (want,) = RMS_NORM.reference(feeds["x32"], numpy_helper.to_array(inits[0]), 1e-6)
    assert np.abs(got - want).max() / np.abs(want).max() < (1e-2 if elem == TensorProto.BFLOAT16 else 2e-3)
    if elem == TensorProto.FLOAT16:  # ORT CPU has no bfloat16 Mul to run the original with
        # the original rounds the normalised value to 16 bits before the weight multiply, the op once at
        # the end (see ops/rms_norm.py): equal to within about one ulp
        _assert_same(m, out, feeds, rtol=2e-3)


# ---- ONNX RMSNormalization ----------------------------------------------------------------------------
def _rms_op(x, out, scale_shape, **attrs):
    return ([helper.make_node("RMSNormalization", [x, "scale"], [out], **attrs)],
            [_init("scale", RNG.normal(1, 0.2, scale_shape))])


def test_rms_normalization_op():
    nodes, inits = _rms_op("x", "y", H, epsilon=1e-5)
    m = _model(nodes, [_vi("x", ["b", 5, H])], [_vi("y", ["b", 5, H])], inits, opset=23)
    out, rep = _optimize(m)
    assert _fused(rep) == {"rms_norm": 1}
    (node,) = out.graph.node
    assert node.op_type == "RMSNorm" and node.attribute[0].f == pytest.approx(1e-5)
    _assert_same(m, out, _feeds("x"))


@pytest.mark.parametrize("attrs, scale_shape, reason", [
    (dict(axis=1), (5, H), "not the last axis"),
    (dict(stash_type=0), H, "stash_type"),
    (dict(), (1, H), "the weight must be [48]"),
])
def test_rms_normalization_op_refusals(attrs, scale_shape, reason):
    nodes, inits = _rms_op("x", "y", scale_shape, **attrs)
    m = _model(nodes, [_vi("x", [2, 5, H])], [_vi("y", [2, 5, H])], inits, opset=23)
    out, rep = _optimize(m)
    assert reason in _refusal(rep, "rms_norm")
    assert graph_rewrites.op_counts(out) == {"RMSNormalization": 1}


# ---- the residual add ---------------------------------------------------------------------------------
def _residual(*, read_again: bool, graph_output: bool = False, through_cast: bool = False, b_shape=(2, 5, H)):
    nodes, inits = _decomposed("x", "y", H, cast_in=through_cast, cast_out=through_cast, inv="div_one")
    src = "rms_xf" if through_cast else "x"  # with the Cast, its output is what the stream reads on
    nodes.insert(0, helper.make_node("Add", ["a", "b"], ["x"]))
    outputs = [_vi("y", [2, 5, H])]
    if read_again:
        nodes.append(helper.make_node("Add", [src, "y"], ["next"]))
        outputs.append(_vi("next", [2, 5, H]))
    if graph_output:
        outputs.append(_vi(src, [2, 5, H]))
    inputs = [_vi("a", [2, 5, H]), _vi("b", list(b_shape))]
    return _model(nodes, inputs, outputs, inits), _feeds("a") | _feeds("b", shape=b_shape)


@pytest.mark.parametrize("through_cast", [False, True])
def test_final_norm_drops_the_sum(through_cast):
    m, feeds = _residual(read_again=False, through_cast=through_cast)
    out, rep = _optimize(m)
    assert _fused(rep) == {"rms_norm_decomposed": 1, "add_rms_norm": 1}
    (node,) = out.graph.node
    assert node.op_type == "AddRMSNorm" and list(node.input)[:2] == ["a", "b"]
    assert list(node.output) == ["y", ""]  # "" = the kernel skips the sum
    _assert_same(m, out, feeds)


@pytest.mark.parametrize("through_cast", [False, True])
@pytest.mark.parametrize("graph_output", [False, True])
def test_residual_stream_keeps_the_sum(through_cast, graph_output):
    m, feeds = _residual(read_again=not graph_output, graph_output=graph_output, through_cast=through_cast)
    out, rep = _optimize(m)
    assert _fused(rep) == {"rms_norm_decomposed": 1, "add_rms_norm_keep_sum": 1}, rep.rules
    node = next(n for n in out.graph.node if n.op_type == "AddRMSNorm")
    readers = {i for n in out.graph.node for i in n.input} | {o.name for o in out.graph.output}
    assert node.output[1] and node.output[1] in readers
    assert "Cast" not in graph_rewrites.op_counts(out)
    _assert_same(m, out, feeds)


def test_refuses_broadcasting_add():
    m, feeds = _residual(read_again=False, b_shape=(H,))
    out, rep = _optimize(m)
    assert "not provably equal" in _refusal(rep, "add_rms_norm")
    assert graph_rewrites.op_counts(out) == {"Add": 1, "ai.ort_triton.RMSNorm": 1}
    _assert_same(m, out, feeds)


def test_refuses_unknown_dims_that_may_broadcast():
    """[?, 5, H] + [?, 5, H]: either unknown dim may be 1 (a broadcast), so the shapes are not provably equal."""
    nodes, inits = _decomposed("x", "y", H)
    nodes.insert(0, helper.make_node("Add", ["a", "b"], ["x"]))
    m = _model(nodes, [_vi("a", [None, 5, H]), _vi("b", [None, 5, H])], [_vi("y", [None, 5, H])], inits)
    _, rep = _optimize(m)
    assert "not provably equal" in _refusal(rep, "add_rms_norm")


# ---- refusals of the decomposed form ------------------------------------------------------------------
def _refused_decomposed(reason, x_shape=(2, 5, H), x_type=TensorProto.FLOAT, opset=17, extra_inputs=(),
                        **kwargs):
    nodes, inits = _decomposed("x", "y", H, **kwargs)
    names = {i.name for i in extra_inputs}
    inits = [t for t in inits if t.name not in names]
    m = _model(nodes, [_vi("x", list(x_shape), x_type), *extra_inputs], [_vi("y", None, x_type)], inits, opset)
    out, rep = _optimize(m)
    why = _refusal(rep, "rms_norm_decomposed")
    assert any(r in why for r in ((reason,) if isinstance(reason, str) else reason)), why
    assert not any(n.domain == DOMAIN for n in out.graph.node)


def test_refuses_a_norm_over_another_axis():
    _refused_decomposed("not the last axis", axes=(1,), weight_shape=(5, H))


def test_refuses_a_weight_that_is_not_a_vector():
    _refused_decomposed("the weight must be [48]", weight_shape=(1, 1, H))


def test_refuses_a_dynamic_hidden_size():
    _refused_decomposed("not static", x_shape=(2, 5, "hidden"))


def test_refuses_an_epsilon_that_is_not_constant():
    _refused_decomposed("epsilon is not a constant scalar", extra_inputs=[_vi("rms_eps", [])])


def test_refuses_another_exponent():
    _refused_decomposed("Pow exponent is not the constant 2", two=3.0)


def test_refuses_a_cast_to_16_bits():
    """An fp32 model normalising in fp16 (Cast to float16 first) is not an fp32 RMSNorm. Two rules see it:
    the one with the first Cast (cast to FLOAT16, not float) and the one starting after it (an fp16 input
    with an fp32 result); the report keeps the last refusal per node."""
    _refused_decomposed(("not float", "the result is FLOAT, the input FLOAT16"), cast_in=True, cast_out=True,
                        to=TensorProto.FLOAT16)


def test_refuses_double():
    nodes, inits = _decomposed("x", "y", H)
    inits = [numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name) for t in inits]
    m = _model(nodes, [_vi("x", [2, H], TensorProto.DOUBLE)], [_vi("y", [2, H], TensorProto.DOUBLE)], inits)
    _, rep = _optimize(m)
    assert "DOUBLE" in _refusal(rep, "rms_norm_decomposed")


def test_optimizing_twice_is_the_same_as_once():
    m, _ = _residual(read_again=True)
    once = graph_rewrites.optimize(m)
    _, rep = graph_rewrites.optimize(once, report=True)
    assert rep.fused() == 0


# ---- real exports -------------------------------------------------------------------------------------
EXPORTS = [("llama-tiny", "dynamo", None), ("llama-tiny", "torchscript", None), ("llama-tiny", "dynamo", 23),
           ("mistral-tiny", "dynamo", None), ("mistral-tiny", "torchscript", None),
           ("qwen2-tiny", "dynamo", None), ("qwen2-tiny", "torchscript", None)]


@pytest.mark.parametrize("name, exporter, opset", EXPORTS, ids=lambda v: str(v))
def test_decoder_exports(name, exporter, opset, tmp_path):
    """Every norm fused: one RMSNorm (layer 0's input norm reads the embedding) and 2L AddRMSNorm, all
    but the final norm keeping the sum (the residual stream); logits equal to the original's."""
    from ort_triton import decoders

    model = decoders.build(name)
    path = decoders.export(model, tmp_path / "m.onnx", exporter=exporter, cache=False, opset=opset)
    m = onnx.load(str(path))
    out, rep = _optimize(m)
    layers = model.config.num_hidden_layers
    counts = graph_rewrites.op_counts(out)
    assert counts["ai.ort_triton.RMSNorm"] == 1 and counts["ai.ort_triton.AddRMSNorm"] == 2 * layers, counts
    assert "ReduceMean" not in counts and "RMSNormalization" not in counts
    assert rep.rules["rms_norm" if opset == 23 else "rms_norm_decomposed"].matched == 2 * layers + 1
    sums = [n.output[1] for n in out.graph.node if n.op_type == "AddRMSNorm"]
    assert sum(bool(s) for s in sums) == 2 * layers - 1  # the final norm's sum is read by nobody
    feeds = decoders.sample_inputs(model, batch=2, seq=9, past=0, cache=False, left_pad=3)
    _assert_same(m, out, feeds)
