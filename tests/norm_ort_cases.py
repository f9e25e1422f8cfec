"""What the GPU tests of the row norms through ORT share (tests/gpu/test_layer_norm_ort.py, test_rms_norm_ort.py):
a norm graph as users have it, with and without the residual Add (and its sum as an output), wrapped in Casts so
fp16 and bf16 run with fp32 numpy I/O; graph_rewrites fuses it, ORT's CUDA EP runs it with the library, and the
launch count proves the Triton kernel ran, not the function body."""

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

import graph_rewrites
from ort_triton.runtime import launch_count, make_session

# element type: (ONNX type, torch dtype for rounding the reference's inputs, relative tolerance)
TYPES = {"float": (TensorProto.FLOAT, torch.float32, 1e-5), "float16": (TensorProto.FLOAT16, torch.float16, 1e-2),
         "bfloat16": (TensorProto.BFLOAT16, torch.bfloat16, 2e-2)}
MODES = ["plain", "residual", "residual+sum"]


def norm_model(shape, type_name, mode, norm, vectors: dict, opset: int):
    """x [+ r] -> norm -> y in the element type. norm(src) is the norm node reading src and the vectors by their
    names; vectors (name -> fp32 [H]) are initializers NAME32 cast to the type (ORT folds those Casts; the
    rewriter sees typed values through them). residual+sum: the Add's output is an output too."""
    t = TYPES[type_name][0]
    nodes = [helper.make_node("Cast", ["x32"], ["x"], to=t)]
    inputs = [helper.make_tensor_value_info("x32", TensorProto.FLOAT, shape)]
    src = "x"
    if mode != "plain":
        nodes += [helper.make_node("Cast", ["r32"], ["r"], to=t), helper.make_node("Add", ["x", "r"], ["s"])]
        inputs.append(helper.make_tensor_value_info("r32", TensorProto.FLOAT, shape))
        src = "s"
    nodes += [helper.make_node("Cast", [name + "32"], [name], to=t) for name in vectors]
    nodes += [norm(src), helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT)]
    outputs = [helper.make_tensor_value_info("y32", TensorProto.FLOAT, shape)]
    if mode == "residual+sum":
        nodes.append(helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.FLOAT))
        outputs.append(helper.make_tensor_value_info("s32", TensorProto.FLOAT, shape))
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), name + "32") for name, v in vectors.items()]
    graph = helper.make_graph(nodes, "norm", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10 if opset >= 23 else 9)


def layer_norm_model(shape, type_name, mode):
    """LayerNormalization (opset 17, epsilon 1e-5) of norm_model; its gamma and beta ("g", "b") drawn from H."""
    h = shape[-1]
    rng = np.random.default_rng(h)
    vectors = {"g": rng.normal(1, 0.3, h), "b": rng.normal(0, 0.3, h)}
    norm = lambda src: helper.make_node("LayerNormalization", [src, "g", "b"], ["y"], axis=-1, epsilon=1e-5)
    return norm_model(shape, type_name, mode, norm, vectors, opset=17), vectors


def rounded(a, type_name):
    """a rounded to the element type, as float64: what the kernel reads."""
    return torch.from_numpy(np.asarray(a, np.float32)).to(TYPES[type_name][1]).double().numpy()


def run_fused(gpu_library, model, fused_op: str, feeds: dict):
    """The model through graph_rewrites (which must make exactly one node, fused_op) on the CUDA EP with the
    library: its outputs, after checking that the Triton kernel ran."""
    optimized, rep = graph_rewrites.optimize(model, report=True)
    ours = [n.op_type for n in optimized.graph.node if n.domain == "ai.ort_triton"]
    assert ours == [fused_op], (ours, rep.rules)
    sess = make_session(optimized, providers=["CUDAExecutionProvider"], library=gpu_library)
    before = launch_count(gpu_library)
    outs = sess.run(None, feeds)
    assert launch_count(gpu_library) == before + 1, "the Triton kernel did not run"
    return outs


def assert_close(outs, wants, type_name):
    """Each output against its float64 reference, relative to the reference's largest magnitude."""
    tol = TYPES[type_name][2]
    for name, got, want in zip(("y", "sum"), outs, wants):
        assert np.isfinite(got).all(), name
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
        assert err < tol, f"{name}: rel err {err:.2e}"
