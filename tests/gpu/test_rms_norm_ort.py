"""On the GPU: rewritten RMSNormalization graphs (opset 23, with and without the residual Add and its sum) on
ORT's CUDA EP with the library, against float64 references.

As tests/gpu/test_layer_norm_ort.py: the model is what a user has (ONNX's RMSNormalization) through
graph_rewrites, wrapped in Casts so fp16 and bf16 run with fp32 numpy I/O; the inputs are rounded to the element
type before the reference sees them; `ort_triton_launches` proves the Triton kernel ran, not the body. The shapes
put H = 2048 on both sides of ops/rms_norm.py's FEW_ROWS (each row count has its own launch config there).
"""

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from ort_triton.ops.rms_norm import FEW_ROWS, reference_add_rms_norm, reference_rms_norm
from ort_triton.runtime import launch_count, make_session

pytestmark = pytest.mark.gpu

TYPES = {"float": (TensorProto.FLOAT, torch.float32, 1e-5), "float16": (TensorProto.FLOAT16, torch.float16, 1e-2),
         "bfloat16": (TensorProto.BFLOAT16, torch.bfloat16, 2e-2)}
EPS = 1e-6


def _model(shape, type_name, residual, keep_sum):
    t = TYPES[type_name][0]
    h = shape[-1]
    nodes = [helper.make_node("Cast", ["x32"], ["x"], to=t)]
    inputs = [helper.make_tensor_value_info("x32", TensorProto.FLOAT, shape)]
    src = "x"
    if residual:
        nodes += [helper.make_node("Cast", ["r32"], ["r"], to=t), helper.make_node("Add", ["x", "r"], ["s"])]
        inputs.append(helper.make_tensor_value_info("r32", TensorProto.FLOAT, shape))
        src = "s"
    nodes += [helper.make_node("Cast", ["g32"], ["g"], to=t),
              helper.make_node("RMSNormalization", [src, "g"], ["y"], axis=-1, epsilon=EPS),
              helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT)]
    outputs = [helper.make_tensor_value_info("y32", TensorProto.FLOAT, shape)]
    if keep_sum:
        nodes.append(helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.FLOAT))
        outputs.append(helper.make_tensor_value_info("s32", TensorProto.FLOAT, shape))
    gamma = np.random.default_rng(h).normal(1, 0.3, h).astype(np.float32)
    g = helper.make_graph(nodes, "rms", inputs, outputs, initializer=[numpy_helper.from_array(gamma, "g32")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _round(a, torch_dtype):
    return torch.from_numpy(a).to(torch_dtype).double().numpy()


SHAPES = [(1, 2048), (16, 2048), (FEW_ROWS, 2048), (FEW_ROWS + 1, 2048), (8, 512, 2048), (3, 93), (5, 16384)]


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["plain", "residual", "residual+sum"])
def test_cuda_ep_runs_the_kernel(gpu_library, type_name, shape, mode):
    residual, keep_sum = mode != "plain", mode == "residual+sum"
    model = _model(shape, type_name, residual, keep_sum)
    optimized, rep = graph_rewrites.optimize(model, report=True)
    ours = [n.op_type for n in optimized.graph.node if n.domain == "ai.ort_triton"]
    assert ours == (["AddRMSNorm"] if residual else ["RMSNorm"]), (ours, rep.rules)
    _, torch_dtype, tol = TYPES[type_name]
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(0.5, 2.0, shape).astype(np.float32)
    r = rng.normal(0, 1, shape).astype(np.float32)
    feeds = {"x32": x, **({"r32": r} if residual else {})}
    sess = make_session(optimized, providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    outs = sess.run(None, feeds)
    assert launch_count(gpu_library) == before + 1, "the Triton kernel did not run"
    g = _round(numpy_helper.to_array(model.graph.initializer[0]), torch_dtype)
    xr, rr = _round(x, torch_dtype), _round(r, torch_dtype)
    if residual:
        want, want_sum = reference_add_rms_norm(xr, rr, g, EPS)
    else:
        (want,) = reference_rms_norm(xr, g, EPS)
    for name, got, ref in [("y", outs[0], want)] + ([("sum", outs[1], want_sum)] if keep_sum else []):
        assert np.isfinite(got).all(), name
        err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)
        assert err < tol, f"{name}: rel err {err:.2e}"
