"""padded_weight: a MatMul on a constant weight whose rows are not 16-byte aligned becomes a MatMul on the weight
padded with zero columns and a Slice back to N, the outputs unchanged; the cases it refuses, with their reasons;
GPT-2 (odd vocabulary) from both exporters, with the rule turned on."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites

RULE = ["padded_weight"]
NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.INT32: np.int32}


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
    return out, rep.rules["padded_weight"]


def _padded(out):
    """The rewritten graph's MatMul, Slice and padded weight."""
    mm = [node for node in out.graph.node if node.op_type == "MatMul"]
    sl = [node for node in out.graph.node if node.op_type == "Slice"]
    assert len(mm) == len(sl) == 1 and sl[0].input[0] == mm[0].output[0], [n.op_type for n in out.graph.node]
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    return mm[0], sl[0], inits


@pytest.mark.parametrize("x_shape, x_dims", [(("batch", "seq", None), (2, 3)), ((5, None), (5,)),
                                             ((2, 3, 4, None), (2, 3, 4)), (("rows", None), (7,))])
@pytest.mark.parametrize("elem, n, n_pad", [(TensorProto.FLOAT, 4097, 4104), (TensorProto.FLOAT16, 4097, 4104),
                                            (TensorProto.FLOAT, 4100, 4104), (TensorProto.FLOAT16, 5003, 5008)])
@pytest.mark.parametrize("transposed", [False, True])
def test_unaligned_weight_is_padded_and_the_output_sliced(x_shape, x_dims, elem, n, n_pad, transposed):
    k = 16  # aligned in fp32 and fp16; N unaligned in fp16 (and >= MIN_N), padded to a multiple of 8 elements
    # (4100 is aligned in fp32, not once --float16 converts the model)
    model = _model(k, n, x_shape=x_shape, elem=elem, transposed=transposed)
    out, st = _rewritten(model)
    assert st.matched == 1 and not st.refused, st
    mm, sl, inits = _padded(out)
    assert not any(node.op_type == "Transpose" for node in out.graph.node)
    w = inits[mm.input[1]]
    source = numpy_helper.to_array(model.graph.initializer[0])
    assert w.shape == (k, n_pad) and w.dtype == NP[elem]
    np.testing.assert_array_equal(w[:, :n], source.T if transposed else source)  # the weight, bit for bit
    assert not w[:, n:].any()  # zero columns
    assert [inits[name].tolist() for name in sl.input[1:]] == [[0], [n], [-1]]
    x = np.random.default_rng(0).standard_normal((*x_dims, k)).astype(NP[elem])
    want, got = _run(model, x)[0], _run(out, x)[0]
    assert got.shape == want.shape == (*x_dims, n)
    tol = 1e-5 if elem == TensorProto.FLOAT else 2e-3
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


def test_tied_weight_keeps_its_table():
    """MatMul(x, Transpose(C)) with C also gathered (a tied lm_head): C stays for the Gather, the MatMul reads a
    padded C^T (ORT would have folded C^T into a copy of its own)."""
    model = _model(16, 4097, transposed=True, shared=True)
    out, st = _rewritten(model)
    assert st.matched == 1, st
    mm, _, inits = _padded(out)
    assert inits[mm.input[1]].shape == (16, 4104) and "c" in inits
    assert next(n for n in out.graph.node if n.op_type == "Gather").input[0] == "c"
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    for a, b in zip(_run(model, x), _run(out, x)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_the_old_weight_is_dropped():
    out, _ = _rewritten(_model(16, 4097))
    assert [list(t.dims) for t in out.graph.initializer if t.data_type == TensorProto.FLOAT] == [[16, 4104]]


def test_an_fp32_model_stays_aligned_through_float16():
    """`optimize --float16` pads first, converts after: the padded weight is 16-byte aligned in fp16 too, and the
    fp16 model gives the fp32 model's outputs to fp16's precision."""
    model = _model(16, 4100)  # 16-byte rows in fp32, 8-byte rows once converted
    out, st = _rewritten(model)
    assert st.matched == 1, st
    half = graph_rewrites.to_float16(out)
    w = next(t for t in half.graph.initializer if "__ot_padded" in t.name)
    assert w.data_type == TensorProto.FLOAT16 and list(w.dims) == [16, 4104] and 4104 * 2 % 16 == 0
    x = np.random.default_rng(2).standard_normal((2, 3, 16)).astype(np.float32)
    want = _run(model, x)[0]
    got = _run(half, x.astype(np.float16))[0].astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


@pytest.mark.parametrize("case, k, n, elem, expect", [
    ("K unaligned", 13, 4097, TensorProto.FLOAT, "K=13 is not 16-byte aligned either"),
    ("int32", 16, 4097, TensorProto.INT32, "is not one of float"),
    ("shared", 16, 4097, TensorProto.FLOAT, "read elsewhere"),
    ("rank 1", 16, 4097, TensorProto.FLOAT, "rank 2 or more"),
])
def test_refusals_say_why(case, k, n, elem, expect):
    model = _model(k, n, elem=elem, shared=case == "shared",
                   x_shape=(None,) if case == "rank 1" else ("batch", "seq", None))
    out, st = _rewritten(model)
    assert st.matched == 0 and st.tried == 1 and any(expect in r.reason for r in st.refused), st
    assert [node.op_type for node in out.graph.node] == [node.op_type for node in model.graph.node]


@pytest.mark.parametrize("case, k, n, elem, transposed", [
    ("aligned", 16, 4096, TensorProto.FLOAT, False), ("aligned fp16", 16, 4104, TensorProto.FLOAT16, False),
    ("aligned, transposed", 16, 4104, TensorProto.FLOAT, True), ("narrow", 16, 13, TensorProto.FLOAT, False),
    ("narrow, transposed", 16, 13, TensorProto.FLOAT, True), ("computed", 16, 4097, TensorProto.FLOAT, False),
])
def test_what_is_no_candidate_is_not_listed(case, k, n, elem, transposed):
    """Nearly every MatMul fails a condition no user would call a defect (aligned, narrow, activations): none
    is counted as tried or listed as refused (common.NOT_A_CANDIDATE), so `optimize -v` stays readable."""
    model = _model(k, n, elem=elem, transposed=transposed, computed=case == "computed")
    out, st = _rewritten(model)
    assert (st.tried, st.matched, st.refused) == (0, 0, []), st
    assert [node.op_type for node in out.graph.node] == [node.op_type for node in model.graph.node]


def test_attention_products_are_no_candidates():
    """Q @ Transpose(K) and P @ V of an unfused attention (4-D activations): not candidates, not refused."""
    f = lambda name, dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)  # noqa: E731
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("MatMul", ["s", "v"], ["y"])]
    graph = helper.make_graph(nodes, "g", [f("q", [1, 2, 5, 13]), f("k", [1, 2, 5, 13]), f("v", [1, 2, 5, 13])],
                              [f("y", None)])
    out, st = _rewritten(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert (st.tried, st.matched, st.refused) == (0, 0, []), st


def test_on_by_default_and_disabled_on_request():
    model = _model(16, 4097)
    assert [node.op_type for node in graph_rewrites.optimize(model).graph.node] == ["MatMul", "Slice"]
    out, rep = graph_rewrites.optimize(model, report=True, disable=RULE)
    assert "padded_weight" not in rep.rules and [node.op_type for node in out.graph.node] == ["MatMul"]


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_gpt2_lm_head(tmp_path, exporter):
    """GPT-2 tiny (vocabulary 4099, odd as GPT-2's 50257), with the cache, every default rule (this one among them):
    the lm_head reads the weight padded to 4104 columns and is sliced back to 4099, the old [hidden, vocab]
    weight (torchscript) or the Transpose of the tied table (dynamo) is gone, and the outputs equal the
    original's for a prefill and a decode step."""
    from ort_triton import decoders

    model = decoders.build("gpt2-tiny")
    src = decoders.export(model, tmp_path / "g.onnx", exporter=exporter, cache=True)
    out, rep = graph_rewrites.optimize(str(src), report=True)
    st = rep.rules["padded_weight"]
    assert st.matched == 1, st
    vocab, hidden = model.config.vocab_size, model.config.n_embd
    inits = {t.name: list(t.dims) for t in out.graph.initializer}
    padded = [n for n in out.graph.node if n.op_type == "MatMul" and "__ot_padded" in n.input[1]]
    assert len(padded) == 1 and inits[padded[0].input[1]] == [hidden, 4104], padded
    assert [hidden, vocab] not in inits.values()  # the old one dropped
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq, past in ((2, 5, 0), (2, 1, 4)):
        feeds = decoders.sample_inputs(model, batch, seq, past, seed=seq + past)
        for x, y in zip(a.run(None, feeds), b.run(None, feeds)):
            assert x.shape == y.shape and np.abs(x - y).max() / np.abs(x).max() < 1e-5
    assert onnx.checker.check_model(out) is None
