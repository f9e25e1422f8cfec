"""linear: a MatMul by a constant weight becomes Linear on the weight stored transposed (a tied Transpose(C) reads
C as it is), the outputs unchanged on ORT CPU through the function body; the refusals, with their reasons; every
decoder from both exporters with every default rule and this one, prefill and decode steps equal."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from ort_triton.contract import DOMAIN

RULE = ["linear"]
NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def _model(k, n, *, x_shape=("batch", "seq", None), elem=TensorProto.FLOAT, transposed=False, shared=False,
           computed=False, weight_input=False):
    """y = x @ W (W [K, N] an initializer, or Transpose(C [N, K]) when transposed; `shared` reads W or C elsewhere
    too; `computed` multiplies by Relu(W); `weight_input` makes W a graph input with an initializer default)."""
    rng = np.random.default_rng(k * 1000 + n)
    dims = [d if d is not None else k for d in x_shape]
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(NP[elem])
    name = "c" if transposed else "w"
    nodes, outputs = [], [helper.make_tensor_value_info("y", elem, None)]
    inputs = [helper.make_tensor_value_info("x", elem, dims)]
    if weight_input:
        inputs.append(helper.make_tensor_value_info(name, elem, list(w.shape)))
    weight = name
    if transposed:
        nodes.append(helper.make_node("Transpose", ["c"], ["ct"], perm=[1, 0]))
        weight = "ct"
    if shared:
        nodes.append(helper.make_node("Identity", [name], ["copy"]))
        outputs.append(helper.make_tensor_value_info("copy", elem, None))
    if computed:
        nodes.append(helper.make_node("Relu", [weight], ["relu"]))
        weight = "relu"
    nodes.append(helper.make_node("MatMul", ["x", weight], ["y"], name="proj"))
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(w, name)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _rewritten(model):
    out, rep = graph_rewrites.optimize(model, report=True, only=RULE)
    return out, rep.rules["linear"]


@pytest.mark.parametrize("x_shape, x_dims", [(("batch", "seq", None), (2, 3)), ((1, None), (1,)), ((None,), ()),
                                             ((2, 3, 4, None), (2, 3, 4))])
@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16])
@pytest.mark.parametrize("transposed, shared", [(False, False), (True, False), (True, True)])
def test_matmul_becomes_linear_and_equal(x_shape, x_dims, elem, transposed, shared):
    k, n = 24, 40
    model = _model(k, n, x_shape=x_shape, elem=elem, transposed=transposed, shared=shared)
    out, st = _rewritten(model)
    assert st.matched == 1 and not st.refused, st
    onnx.checker.check_model(out, full_check=True)
    ops = collections.Counter(node.op_type for node in out.graph.node)
    assert ops["Linear"] == 1 and ops["MatMul"] == 0 and ops["Transpose"] == 0, ops
    lin = next(node for node in out.graph.node if node.op_type == "Linear")
    assert lin.domain == DOMAIN
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    source = numpy_helper.to_array(model.graph.initializer[0])
    # the weight as [N, K]: bit for bit the transposed W, or C itself (no copy of a tied table)
    np.testing.assert_array_equal(inits[lin.input[1]], source if transposed else source.T)
    assert (lin.input[1] == "c") == transposed and ("w" not in inits)  # the old W dropped
    x = np.random.default_rng(1).standard_normal((*x_dims, k)).astype(NP[elem])
    for want, got in zip(_run(model, {"x": x}), _run(out, {"x": x})):
        assert want.shape == got.shape
        tol = 1e-6 if elem == TensorProto.FLOAT else 1e-2
        assert np.abs(want.astype(np.float64) - got).max() <= tol * np.abs(want).max()


@pytest.mark.parametrize("case, kwargs, reason", [
    ("shared W", dict(shared=True), "read elsewhere too"),
    ("W a graph input", dict(weight_input=True), "read elsewhere too"),
    ("x's last dim not K", dict(x_shape=(2, 5)), "last dim 5 is not the weight's K=24"),
])
def test_refusals_say_why(case, kwargs, reason):
    out, st = _rewritten(_model(24, 40, **kwargs))
    assert st.matched == 0 and len(st.refused) == 1 and reason in st.refused[0].reason, (case, st)
    assert [node.op_type for node in out.graph.node if node.op_type == "MatMul"] == ["MatMul"]


def test_computed_weights_are_no_candidates():
    out, st = _rewritten(_model(24, 40, computed=True))
    assert st.matched == 0 and st.tried == 0 and not st.refused, st


def test_a_transposed_graph_input_is_read_as_it_is():
    """Transpose(C), C a graph input: Linear reads C (a value fed at run time is honoured: no copy is made)."""
    model = _model(24, 40, transposed=True, weight_input=True)
    out, st = _rewritten(model)
    assert st.matched == 1, st
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((2, 3, 24)).astype(np.float32),
             "c": rng.standard_normal((40, 24)).astype(np.float32)}
    np.testing.assert_allclose(_run(out, feeds)[0], _run(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_off_by_default():
    assert "linear" not in graph_rewrites.optimize(_model(24, 40), report=True)[1].rules
    out, rep = graph_rewrites.optimize(_model(24, 40), report=True, enable=RULE)
    assert rep.rules["linear"].matched == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "qwen2-tiny", "phi-tiny"])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_decoders_with_every_rule(decoder_exports, name, exporter):
    """Every default rule and this one: every constant-weight MatMul left is a Linear, and a prefill and a decode
    step (batch 1, the GEMV's shape, and 2) give the original's outputs."""
    from ort_triton import decoders

    model, src = decoder_exports(name, exporter)
    out, rep = graph_rewrites.optimize(str(src), report=True, enable=RULE)
    st = rep.rules["linear"]
    ops = collections.Counter(node.op_type for node in out.graph.node)
    assert st.matched >= 4 * model.config.num_hidden_layers // 2 and ops["Linear"] == st.matched, (st, ops)
    consts = {t.name for t in out.graph.initializer}
    assert not [n.name for n in out.graph.node if n.op_type == "MatMul" and n.input[1] in consts]
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq, past in ((1, 5, 0), (1, 1, 4), (2, 1, 4)):
        feeds = decoders.sample_inputs(model, batch, seq, past, seed=seq + past)
        for x, y in zip(a.run(None, feeds), b.run(None, feeds)):
            assert x.shape == y.shape and np.abs(x - y).max() / np.abs(x).max() < 1e-5
