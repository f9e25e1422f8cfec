"""On the GPU: rewritten RMSNormalization graphs (opset 23, with and without the residual Add and its sum) on
ORT's CUDA EP with the library, against float64 references.

As tests/gpu/test_layer_norm_ort.py: the model is what a user has (ONNX's RMSNormalization) through
graph_rewrites, wrapped in Casts so fp16 and bf16 run with fp32 numpy I/O; the inputs are rounded to the element
type before the reference sees them; `ort_triton_launches` proves the Triton kernel ran, not the body. The shapes
put H = 2048 on both sides of ops/rms_norm.py's FEW_ROWS (each row count has its own launch config there).
"""

import numpy as np
import pytest
from onnx import helper

from ort_triton.ops.rms_norm import FEW_ROWS, reference_add_rms_norm, reference_rms_norm
from tests.norm_ort_cases import MODES, TYPES, assert_close, norm_model, rounded, run_fused

pytestmark = pytest.mark.gpu

EPS = 1e-6
SHAPES = [(1, 2048), (16, 2048), (FEW_ROWS, 2048), (FEW_ROWS + 1, 2048), (8, 512, 2048), (3, 93), (5, 16384)]


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", MODES)
def test_cuda_ep_runs_the_kernel(gpu_library, type_name, shape, mode):
    vectors = {"g": np.random.default_rng(shape[-1]).normal(1, 0.3, shape[-1])}
    norm = lambda src: helper.make_node("RMSNormalization", [src, "g"], ["y"], axis=-1, epsilon=EPS)
    model = norm_model(shape, type_name, mode, norm, vectors, opset=23)
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(0.5, 2.0, shape).astype(np.float32)
    r = rng.normal(0, 1, shape).astype(np.float32)
    feeds = {"x32": x, **({"r32": r} if mode != "plain" else {})}
    outs = run_fused(gpu_library, model, "RMSNorm" if mode == "plain" else "AddRMSNorm", feeds)
    g, xr, rr = (rounded(a, type_name) for a in (vectors["g"], x, r))
    wants = reference_rms_norm(xr, g, EPS) if mode == "plain" else reference_add_rms_norm(xr, rr, g, EPS)
    assert len(outs) == (2 if mode == "residual+sum" else 1)
    assert_close(outs, wants, type_name)
