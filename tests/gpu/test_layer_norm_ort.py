"""On the GPU: rewritten LayerNorm graphs on ORT's CUDA EP with the library, against float64 references.

The model is built the way users get it (a standard LayerNormalization graph through graph_rewrites),
wrapped in Casts so fp16 and bf16 run with fp32 numpy I/O; the inputs are rounded to the element type
before the reference sees them. `ort_triton_launches` proves the Triton kernel ran, not the body.
"""


import numpy as np
import onnxruntime as ort
import pytest

from ort_triton.ops.layer_norm import reference_add_layer_norm, reference_layer_norm
from ort_triton.runtime import make_session
from tests.conftest import layer_norm_node_model
from tests.norm_ort_cases import MODES, TYPES, assert_close, layer_norm_model, rounded, run_fused

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (3, 93), (2, 7, 768), (4096, 1024), (5, 16384), (257, 4095)]


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", MODES)
def test_cuda_ep_runs_the_kernel(gpu_library, type_name, shape, mode):
    model, vectors = layer_norm_model(shape, type_name, mode)
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(3.0, 2.0, shape).astype(np.float32)  # offset mean: a one-pass variance would show
    r = rng.normal(0, 1, shape).astype(np.float32)
    feeds = {"x32": x, **({"r32": r} if mode != "plain" else {})}
    outs = run_fused(gpu_library, model, "LayerNorm" if mode == "plain" else "AddLayerNorm", feeds)
    g, b, xr, rr = (rounded(a, type_name) for a in (vectors["g"], vectors["b"], x, r))
    if mode == "plain":
        wants = reference_layer_norm(xr, g, b, 1e-5)
    else:
        wants = reference_add_layer_norm(xr, rr, np.zeros_like(g), g, b, 1e-5)
    assert len(outs) == (2 if mode == "residual+sum" else 1)
    assert_close(outs, wants, type_name)


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
