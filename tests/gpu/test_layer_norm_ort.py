"""On the GPU: rewritten LayerNorm graphs on ORT's CUDA EP with the library, against float64 references.

The model is built the way users get it (a standard LayerNormalization graph through graph_rewrites),
wrapped in Casts so fp16 and bf16 run with fp32 numpy I/O; the inputs are rounded to the element type
before the reference sees them. `ort_triton_launches` proves the Triton kernel ran, not the body.
"""


import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from ort_triton.ops.layer_norm import reference_add_layer_norm, reference_layer_norm
from ort_triton.runtime import launch_count, make_session
from tests.conftest import layer_norm_node_model

pytestmark = pytest.mark.gpu

TYPES = {"float": (TensorProto.FLOAT, torch.float32, 1e-5), "float16": (TensorProto.FLOAT16, torch.float16, 1e-2),
         "bfloat16": (TensorProto.BFLOAT16, torch.bfloat16, 2e-2)}


def _model(shape, type_name, residual, keep_sum):
    t = TYPES[type_name][0]
    h = shape[-1]
    rng = np.random.default_rng(h)
    nodes = [helper.make_node("Cast", ["x32"], ["x"], to=t)]
    inputs = [helper.make_tensor_value_info("x32", TensorProto.FLOAT, shape)]
    src = "x"
    if residual:
        nodes += [helper.make_node("Cast", ["r32"], ["r"], to=t), helper.make_node("Add", ["x", "r"], ["s"])]
        inputs.append(helper.make_tensor_value_info("r32", TensorProto.FLOAT, shape))
        src = "s"
    nodes += [helper.make_node("Cast", ["g32"], ["g"], to=t), helper.make_node("Cast", ["b32"], ["b"], to=t),
              helper.make_node("LayerNormalization", [src, "g", "b"], ["y"], axis=-1, epsilon=1e-5),
              helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT)]
    outputs = [helper.make_tensor_value_info("y32", TensorProto.FLOAT, shape)]
    if keep_sum:
        nodes.append(helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.FLOAT))
        outputs.append(helper.make_tensor_value_info("s32", TensorProto.FLOAT, shape))
    inits = [numpy_helper.from_array(rng.normal(1, 0.3, h).astype(np.float32), "g32"),
             numpy_helper.from_array(rng.normal(0, 0.3, h).astype(np.float32), "b32")]
    # The Casts of gamma/beta are constant-folded by ORT; the rewriter sees typed values through them.
    g = helper.make_graph(nodes, "ln", inputs, outputs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)



def _round(a, torch_dtype):
    return torch.from_numpy(a).to(torch_dtype).double().numpy()


SHAPES = [(1, 1), (3, 93), (2, 7, 768), (4096, 1024), (5, 16384), (257, 4095)]


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["plain", "residual", "residual+sum"])
def test_cuda_ep_runs_the_kernel(gpu_library, type_name, shape, mode):
    residual, keep_sum = mode != "plain", mode == "residual+sum"
    model = _model(shape, type_name, residual, keep_sum)
    optimized, rep = graph_rewrites.optimize(model, report=True)
    ours = [n.op_type for n in optimized.graph.node if n.domain == "ai.ort_triton"]
    assert ours == (["AddLayerNorm"] if residual else ["LayerNorm"]), (ours, rep.rules)
    _, torch_dtype, tol = TYPES[type_name]
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(3.0, 2.0, shape).astype(np.float32)  # offset mean: a one-pass variance would show
    r = rng.normal(0, 1, shape).astype(np.float32)
    feeds = {"x32": x, **({"r32": r} if residual else {})}
    sess = make_session(optimized, providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    outs = sess.run(None, feeds)
    assert launch_count(gpu_library) == before + 1, "the Triton kernel did not run"
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    g, b = _round(inits["g32"], torch_dtype), _round(inits["b32"], torch_dtype)
    xr, rr = _round(x, torch_dtype), _round(r, torch_dtype)
    if residual:
        want, want_sum = reference_add_layer_norm(xr, rr, np.zeros_like(g), g, b, 1e-5)
    else:
        (want,) = reference_layer_norm(xr, g, b, 1e-5)
    for name, got, ref in [("y", outs[0], want)] + ([("sum", outs[1], want_sum)] if keep_sum else []):
        assert np.isfinite(got).all(), name
        err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)
        assert err < tol, f"{name}: rel err {err:.2e}"


def test_bad_hidden_size_is_an_ort_error_and_the_next_run_works(gpu_library):
    """A node no kernel covers (hand-made: the rewriter would refuse it) fails with a message that names the
    op; the session and process carry on."""
    h = 20000
    sess = make_session(layer_norm_node_model("h"), providers=["CUDAExecutionProvider"], library=gpu_library)
    expected = r"ort_triton LayerNorm \(float\): hidden size H=20000 is not supported"
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=expected):
        sess.run(None, {"x": np.ones((2, h), np.float32), "g": np.ones(h, np.float32), "b": np.ones(h, np.float32)})
    x = np.random.default_rng(0).normal(size=(2, 64)).astype(np.float32)
    (y,) = sess.run(None, {"x": x, "g": np.ones(64, np.float32), "b": np.zeros(64, np.float32)})
    (want,) = reference_layer_norm(x, np.ones(64), np.zeros(64))
    assert np.abs(y - want).max() < 1e-4
