"""add_rms_norm_linear and add_rms_norm_swiglu: AddRMSNorm and the projections that read it become one op (the weights
stored transposed), the outputs unchanged on ORT CPU through the function bodies; the refusals, with their reasons;
Llama and Qwen2 from both exporters with every default rule and these two, prefill and decode steps equal."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from ort_triton.contract import DOMAIN

RULES = ["add_rms_norm_linear", "add_rms_norm_swiglu"]
NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
PRE = ["rms_norm", "add_rms_norm", "add_rms_norm_keep_sum", "silu_mul"]  # what makes AddRMSNorm and SiluMul first


def _model(k, n, *, form="linear", elem=TensorProto.FLOAT, keep_sum=True, extra_reader=False, shared=False,
           tied_input=False):
    """s = a + b; y = RMSNormalization(s) (opset 23) @ W, or SiLU(y @ Wg) * (y @ Wu) (form "swiglu"), or y @
    Transpose(C) (form "tied"); keep_sum: s is an output too; extra_reader: the norm is an output too; shared: the
    (gate) weight is also read by an Identity; tied_input: C is a graph input."""
    rng = np.random.default_rng(k * 100 + n)
    t = NP[elem]
    vi = helper.make_tensor_value_info
    inits = [numpy_helper.from_array(rng.normal(1, 0.1, k).astype(t), "g")]
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]),
             helper.make_node("RMSNormalization", ["s", "g"], ["nrm"], epsilon=1e-5, axis=-1)]
    outputs = [vi("y", elem, None)] + ([vi("s", elem, None)] if keep_sum else []) + (
        [vi("nrm", elem, None)] if extra_reader else [])
    inputs = [vi("a", elem, ["batch", "seq", k]), vi("b", elem, ["batch", "seq", k])]
    w = lambda name, shape: inits.append(numpy_helper.from_array((rng.normal(size=shape) / k ** 0.5).astype(t),  # noqa
                                                                   name))
    if form == "linear":
        w("w", (k, n))
        nodes.append(helper.make_node("MatMul", ["nrm", "w"], ["y"], name="proj"))
    elif form == "tied":
        w("c", (n, k))
        nodes += [helper.make_node("Transpose", ["c"], ["ct"], perm=[1, 0]),
                  helper.make_node("MatMul", ["nrm", "ct"], ["y"], name="lm_head")]
        if tied_input:
            inputs.append(vi("c", elem, [n, k]))
    else:
        w("wg", (k, n))
        w("wu", (k, n))
        nodes += [helper.make_node("MatMul", ["nrm", "wg"], ["gate"]),
                  helper.make_node("MatMul", ["nrm", "wu"], ["up"]), helper.make_node("Sigmoid", ["gate"], ["sig"]),
                  helper.make_node("Mul", ["gate", "sig"], ["silu"]),
                  helper.make_node("Mul", ["silu", "up"], ["y"])]
    if shared:
        nodes.append(helper.make_node("Identity", ["wg" if form == "swiglu" else "w"], ["copy"]))
        outputs.append(vi("copy", elem, None))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(k, elem, extra=None):
    rng = np.random.default_rng(k)
    feeds = {name: rng.standard_normal((2, 3, k)).astype(NP[elem]) for name in ("a", "b")}
    return {**feeds, **(extra or {})}


def _same(model, out, feeds, elem):
    for want, got in zip(_run(model, feeds), _run(out, feeds)):
        assert want.shape == got.shape
        tol = 1e-5 if elem == TensorProto.FLOAT else 1e-2
        assert np.abs(want.astype(np.float64) - got).max() <= tol * np.abs(want).max()


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16])
@pytest.mark.parametrize("form, op", [("linear", "AddRMSNormLinear"), ("tied", "AddRMSNormLinear"),
                                      ("swiglu", "AddRMSNormSwiGLU")])
@pytest.mark.parametrize("keep_sum", [True, False])
def test_norm_and_projection_become_one_op_and_equal(elem, form, op, keep_sum):
    k, n = 24, 40
    model = _model(k, n, form=form, elem=elem, keep_sum=keep_sum)
    out, rep = graph_rewrites.optimize(model, report=True, only=PRE + RULES)
    st = rep.rules["add_rms_norm_swiglu" if form == "swiglu" else "add_rms_norm_linear"]
    assert st.matched == 1 and not st.refused, st
    onnx.checker.check_model(out, full_check=True)
    ops = collections.Counter(node.op_type for node in out.graph.node)
    assert ops[op] == 1 and ops["MatMul"] == ops["AddRMSNorm"] == ops["SiluMul"] == ops["Transpose"] == 0, ops
    node = next(nd for nd in out.graph.node if nd.op_type == op)
    assert node.domain == DOMAIN and (node.output[1] != "") == keep_sum
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    source = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    # the weights as [N, K]: bit for bit the transposed W, or C itself (no copy of a tied table)
    for name, wt in zip(["wg", "wu"] if form == "swiglu" else ["c" if form == "tied" else "w"], node.input[3:]):
        np.testing.assert_array_equal(inits[wt], source[name] if form == "tied" else source[name].T)
    _same(model, out, _feeds(k, elem), elem)


@pytest.mark.parametrize("case, kwargs, rule, reason", [
    ("the norm is an output too", dict(extra_reader=True), "add_rms_norm_linear", "used outside the fused region"),
    ("the norm is an output too", dict(form="swiglu", extra_reader=True), "add_rms_norm_swiglu",
     "used outside the fused region"),
    ("shared W", dict(shared=True), "add_rms_norm_linear", "read elsewhere too"),
    ("shared Wg", dict(form="swiglu", shared=True), "add_rms_norm_swiglu", "read elsewhere too"),
])
def test_refusals_say_why(case, kwargs, rule, reason):
    model = _model(24, 40, **kwargs)
    out, rep = graph_rewrites.optimize(model, report=True, only=PRE + RULES)
    st = rep.rules[rule]
    assert st.matched == 0 and len(st.refused) == 1 and reason in st.refused[0].reason, (case, st)
    _same(model, out, _feeds(24, TensorProto.FLOAT), TensorProto.FLOAT)


def test_a_tied_graph_input_is_read_as_it_is():
    """Transpose(C), C a graph input: the op reads C (a value fed at run time is honoured: no copy is made)."""
    model = _model(24, 40, form="tied", tied_input=True)
    out, rep = graph_rewrites.optimize(model, report=True, only=PRE + RULES)
    assert rep.rules["add_rms_norm_linear"].matched == 1
    c = np.random.default_rng(5).standard_normal((40, 24)).astype(np.float32)
    _same(model, out, _feeds(24, TensorProto.FLOAT, {"c": c}), TensorProto.FLOAT)


def test_off_by_default():
    rep = graph_rewrites.optimize(_model(24, 40), report=True)[1]
    assert not set(RULES) & set(rep.rules) and rep.ops_after["ai.ort_triton.AddRMSNorm"] == 1
    rep = graph_rewrites.optimize(_model(24, 40), report=True, enable=RULES)[1]
    assert rep.rules["add_rms_norm_linear"].matched == 1


def test_linear_takes_what_is_left():
    """With `linear` on too, the norm's projection is ours first (stage 13) and linear (14) finds no MatMul left."""
    rep = graph_rewrites.optimize(_model(24, 40), report=True, enable=RULES + ["linear"])[1]
    assert rep.rules["add_rms_norm_linear"].matched == 1 and rep.rules["linear"].matched == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_decoders_with_every_rule(decoder_exports, name, exporter):
    """Every default rule and these two: each layer's packed Q/K/V and gate/up/SwiGLU read the norm fused in (the
    first layer's norm has no residual add and stays an RMSNorm), and a prefill and decode steps (batch 1, 2 and
    17: the fused kernel's rows and the steps beyond) give the original's outputs."""
    from ort_triton import decoders

    model, src = decoder_exports(name, exporter)
    out, rep = graph_rewrites.optimize(str(src), report=True, enable=RULES)
    layers = model.config.num_hidden_layers
    ops = collections.Counter(node.op_type for node in out.graph.node)
    # Q/K/V of every layer but the first (whose norm reads the embeddings, no residual), and the final norm's
    # lm_head; gate/up of every layer
    assert rep.rules["add_rms_norm_linear"].matched == layers, (rep.rules["add_rms_norm_linear"], ops)
    assert rep.rules["add_rms_norm_swiglu"].matched == layers, (rep.rules["add_rms_norm_swiglu"], ops)
    assert ops["AddRMSNorm"] == 0 and ops["SiluMul"] == 0 and ops["RMSNorm"] == 1, ops
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq, past in ((1, 5, 0), (1, 1, 4), (2, 1, 4), (17, 1, 3)):
        feeds = decoders.sample_inputs(model, batch, seq, past, seed=seq + past)
        for x, y in zip(a.run(None, feeds), b.run(None, feeds)):
            assert x.shape == y.shape and np.abs(x - y).max() / np.abs(x).max() < 1e-5
