"""transposed_weight: a MatMul on a constant weight whose rows are not 16-byte aligned becomes a Gemm on the
transposed weight (transB=1), the outputs unchanged; the cases it refuses, with their reasons; GPT-2 (odd
vocabulary) from both exporters, with the rule turned on."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

RULE = ["transposed_weight"]
NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def _model(k, n, *, x_shape=("batch", "seq", None), elem=TensorProto.FLOAT, transposed=False, shared=False,
           computed=False):
    """y = x @ W, W [K, N] as an initializer, or Transpose(C [N, K]) (transposed; C also gathered when shared),
    or x @ Relu(W) (computed)."""
    rng = np.random.default_rng(k * 1000 + n)
    dims = [d if d is not None else k for d in x_shape]
    nodes, inits, outputs = [], [], [helper.make_tensor_value_info("y", elem, None)]
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(NP[elem])
    inits.append(numpy_helper.from_array(w, "c" if transposed else "w"))
    weight = "w"
    if transposed:
        nodes.append(helper.make_node("Transpose", ["c"], ["w"], perm=[1, 0]))
        if shared:  # a tied embedding: the same table gathered by token ids
            inits.append(numpy_helper.from_array(np.array([0, 2], dtype=np.int64), "ids"))
            nodes.append(helper.make_node("Gather", ["c", "ids"], ["emb"]))
            outputs.append(helper.make_tensor_value_info("emb", elem, None))
    elif shared:
        nodes.append(helper.make_node("Identity", ["w"], ["w_copy"]))
        outputs.append(helper.make_tensor_value_info("w_copy", elem, None))
    if computed:
        nodes.append(helper.make_node("Relu", ["w"], ["w_relu"]))
        weight = "w_relu"
    nodes.append(helper.make_node("MatMul", ["x", weight], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, dims)], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _rewritten(model):
    out, rep = graph_rewrites.optimize(model, report=True, only=RULE)
    return out, rep.rules["transposed_weight"]


@pytest.mark.parametrize("x_shape, x_dims", [(("batch", "seq", None), (2, 3)), ((5, None), (5,)),
                                             ((2, 3, 4, None), (2, 3, 4)), (("rows", None), (7,))])
@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16])
@pytest.mark.parametrize("transposed", [False, True])
def test_unaligned_weight_becomes_a_gemm_on_its_transpose(x_shape, x_dims, elem, transposed):
    k, n = 16, 13  # 13 elements a row: unaligned in fp32 and fp16; K = 16 aligned in both
    model = _model(k, n, x_shape=x_shape, elem=elem, transposed=transposed)
    out, st = _rewritten(model)
    assert st.matched == 1 and not st.refused, st
    gemms = [node for node in out.graph.node if node.op_type == "Gemm"]
    assert len(gemms) == 1 and not any(node.op_type in ("MatMul", "Transpose") for node in out.graph.node)
    assert {a.name: helper.get_attribute_value(a) for a in gemms[0].attribute} == {"transB": 1}
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert inits[gemms[0].input[1]].shape == (n, k)  # the weight stored [N, K]
    if len(x_dims) == 1:
        assert not any(node.op_type == "Reshape" for node in out.graph.node)  # a 2-D input needs none
    x = np.random.default_rng(0).standard_normal((*x_dims, k)).astype(NP[elem])
    want, got = _run(model, x)[0], _run(out, x)[0]
    assert got.shape == want.shape == (*x_dims, n)
    tol = 1e-5 if elem == TensorProto.FLOAT else 2e-3
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


def test_tied_weight_is_used_as_is():
    """MatMul(x, Transpose(C)) with C also gathered (a tied lm_head): the Gemm reads C itself, no copy."""
    model = _model(16, 13, transposed=True, shared=True)
    out, st = _rewritten(model)
    assert st.matched == 1, st
    gemm = next(node for node in out.graph.node if node.op_type == "Gemm")
    assert gemm.input[1] == "c" and [t.name for t in out.graph.initializer if t.data_type == TensorProto.FLOAT] == ["c"]
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    for a, b in zip(_run(model, x), _run(out, x)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_static_leading_dims_give_a_constant_target():
    model = _model(16, 13, x_shape=(2, 3, None))
    out, _ = _rewritten(model)
    assert not any(node.op_type in ("Shape", "Concat") for node in out.graph.node)
    x = np.ones((2, 3, 16), np.float32)
    np.testing.assert_allclose(_run(out, x)[0], _run(model, x)[0], rtol=1e-5)


@pytest.mark.parametrize("case, k, n, elem, expect", [
    ("aligned", 16, 16, TensorProto.FLOAT, "aligned already"),
    ("aligned fp16", 16, 24, TensorProto.FLOAT16, "aligned already"),
    ("K unaligned", 13, 13, TensorProto.FLOAT, "K=13 is not 16-byte aligned either"),
    ("shared", 16, 13, TensorProto.FLOAT, "read elsewhere"),
    ("computed", 16, 13, TensorProto.FLOAT, "the weight is computed"),
    ("rank 1", 16, 13, TensorProto.FLOAT, "rank 2 or more"),
])
def test_refusals_say_why(case, k, n, elem, expect):
    model = _model(k, n, elem=elem, shared=case == "shared", computed=case == "computed",
                   x_shape=(None,) if case == "rank 1" else ("batch", "seq", None))
    out, st = _rewritten(model)
    assert st.matched == 0 and any(expect in r.reason for r in st.refused), st
    assert [node.op_type for node in out.graph.node] == [node.op_type for node in model.graph.node]


def test_off_by_default():
    out, rep = graph_rewrites.optimize(_model(16, 13), report=True)
    assert rep.rules.get("transposed_weight") is None or rep.rules["transposed_weight"].matched == 0
    assert [node.op_type for node in out.graph.node] == ["MatMul"]


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_gpt2_lm_head(tmp_path, exporter):
    """GPT-2 tiny (vocabulary 509, odd as GPT-2's 50257), with the cache, every default rule plus this one: the
    lm_head is the only Gemm, on the transposed (dynamo: the tied embedding table itself) weight, and the
    outputs equal the original's for a prefill and a decode step."""
    from ort_triton import decoders

    model = decoders.build("gpt2-tiny")
    src = decoders.export(model, tmp_path / "g.onnx", exporter=exporter, cache=True)
    out, rep = graph_rewrites.optimize(str(src), report=True, enable=RULE)
    st = rep.rules["transposed_weight"]
    assert st.matched == 1 and rep.ops_after["Gemm"] == 1, (st, rep.ops_after)
    gemm = next(node for node in out.graph.node if node.op_type == "Gemm")
    vocab, hidden = model.config.vocab_size, model.config.n_embd
    w = next(t for t in out.graph.initializer if t.name == gemm.input[1])
    assert list(w.dims) == [vocab, hidden]
    assert not [t.name for t in out.graph.initializer if list(t.dims) == [hidden, vocab]]  # the old one dropped
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq, past in ((2, 5, 0), (2, 1, 4)):
        feeds = decoders.sample_inputs(model, batch, seq, past, seed=seq + past)
        for x, y in zip(a.run(None, feeds), b.run(None, feeds)):
            assert x.shape == y.shape and np.abs(x - y).max() / np.abs(x).max() < 1e-5
    assert onnx.checker.check_model(out) is None
