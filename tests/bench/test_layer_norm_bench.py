"""The LayerNorm bench's chains (ort_triton/bench/layer_norm.py) on ORT CPU: ours (through the function
bodies) and ORT's own kernel compute the same thing, so the GPU table compares like with like."""

import numpy as np
import onnxruntime as ort
import pytest

from ort_triton.bench.layer_norm import PAIRS, VARIANTS, chain_model, summary


def _run(variant, feeds):
    sess = ort.InferenceSession(chain_model(variant, 48, "float").SerializeToString(),
                                providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}})


@pytest.mark.parametrize("label, ours, theirs", PAIRS)
def test_chains_agree_with_ort_kernels(label, ours, theirs):
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(5, 48)).astype(np.float32), "r": rng.normal(size=(5, 48)).astype(np.float32)}
    got, want = _run(ours, feeds), _run(theirs, feeds)
    assert len(got) == len(want) == (2 if label.endswith("+sum") else 1)  # the residual stream's last sum too
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_sum_chain_is_a_residual_stream():
    """Each node's sum feeds the next node's skip: the last sum is r plus every y but the last."""
    rng = np.random.default_rng(1)
    x, r = rng.normal(size=(3, 48)).astype(np.float32), rng.normal(size=(3, 48)).astype(np.float32)
    model = chain_model("ort_triton_AddLayerNorm+sum", 48, "float")
    names = [n.output[0] for n in model.graph.node][:-1]  # y0 .. y14
    del model.graph.output[:]
    model.graph.output.extend([_vi(n) for n in ["s15", *names]])
    outs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "r": r})
    np.testing.assert_allclose(outs[0], r + x + sum(outs[1:]), rtol=1e-4, atol=1e-4)


def _vi(name):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def test_summary_reports_spread_and_old_files():
    rows = [dict(type="float16", rows=8, hidden=768, variant=v, us_per_node=2.0, ceiling_frac=0.5,
                 **({"spread": 0.03} if v.startswith("ort_triton") else {})) for v in VARIANTS]
    text = summary(dict(gpu="G", ceiling_gbs=4080, nodes_per_chain=16, instances=3, rows=rows))
    assert "3 session(s)" in text and "| 3.0% / - |" in text and text.count("1.000x") == 3
