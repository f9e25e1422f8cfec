"""The BiasGelu kernel (both forms, with and without the product of BiasGeluMul / BiasGeluTanhMul) against the
float64 reference, poisoned outputs, odd widths (tails of the 1024-wide column blocks, H not a multiple of 16),
several row counts; under the interpreter on CPU. The planners through the library's test hook."""

import os

import numpy as np
import pytest
import torch

from ort_triton.kernels.bias_gelu import bias_gelu
from ort_triton.ops.bias_gelu import reference_bias_gelu, reference_bias_gelu_mul
from tests.native_hooks import load, plan_fields

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 5, 1030), (9, 2048), (4, 3072)], ids=str)
@pytest.mark.parametrize("tanh", [False, True])
@pytest.mark.parametrize("mul", [False, True], ids=["gelu", "gelu_mul"])
def test_matches_reference(dtype, shape, tanh, mul):
    gen = torch.Generator().manual_seed(sum(shape) + tanh)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype).to(DEVICE)
    b = torch.randn(shape[-1], generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    up = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE) if mul else None
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    y = bias_gelu(x, b, tanh, out=out, up=up).double().cpu().numpy()
    x64, b64 = x.double().cpu().numpy(), b.double().cpu().numpy()
    (want,) = (reference_bias_gelu_mul(x64, b64, up.double().cpu().numpy(), tanh) if mul
               else reference_bias_gelu(x64, b64, tanh))
    assert np.isfinite(y).all(), "unwritten elements"
    err = np.abs(y - want).max() / np.abs(want).max()
    assert err < TOL[dtype], err


def test_large_magnitudes_saturate_without_nan():
    """tanh via exp: exp(2z) overflows to inf for large s, which must give gelu(s) = s, not NaN."""
    x = torch.tensor([[-1e4, -30.0, 0.0, 30.0, 1e4]], device=DEVICE)
    for tanh in (False, True):
        y = bias_gelu(x, torch.zeros(5, device=DEVICE), tanh).cpu()
        torch.testing.assert_close(y, torch.tensor([[0.0, 0.0, 0.0, 30.0, 1e4]]), rtol=1e-6, atol=1e-6)


def test_erf_form_keeps_the_negative_tail():
    """gelu(s) for s << 0 is tiny (s * erfc(-s / sqrt 2) / 2) but still a normal fp32 number: each element
    must be right to a relative 1e-4, which 0.5 * s * (1 + erf(s / sqrt 2)) misses by cancelling (the
    kernel goes through erfc, kernels/bias_gelu.py)."""
    x = torch.linspace(-12.0, 8.0, 4001, dtype=torch.float32).reshape(1, -1)
    y = bias_gelu(x.to(DEVICE), torch.zeros(x.shape[1], device=DEVICE)).double().cpu()
    xd = x.double()
    want = 0.5 * xd * torch.special.erfc(-xd / 2**0.5)
    nonzero = want.abs() > 1e-30
    rel = ((y - want).abs() / want.abs().clamp_min(1e-300))[nonzero]
    assert rel.max().item() < 1e-4, (rel.max().item(), x[nonzero][rel.argmax()].item())


def test_bad_bias_is_a_clear_error():
    with pytest.raises(ValueError, match="bias must be"):
        bias_gelu(torch.zeros(2, 8, device=DEVICE), torch.zeros(7, device=DEVICE))
    with pytest.raises(ValueError, match="up must be x's shape"):
        bias_gelu(torch.zeros(2, 8, device=DEVICE), torch.zeros(8, device=DEVICE), up=torch.zeros(1, 8, device=DEVICE))


# ---- the native planners (ort_triton/native/bias_gelu.c), no GPU needed ----------------------------------------

@pytest.mark.parametrize("op", ["BiasGeluMul", "BiasGeluTanhMul"])
@pytest.mark.parametrize("shape, spec", [((3, 5, 2048), 0), ((7, 37), 1)], ids=str)
def test_mul_plan(native_library, op, shape, spec):
    """The grid of (4-row x 1024-column) tiles over [rows, H], the aligned spec where H % 16 == 0, Y X's shape."""
    fields = plan_fields(load(native_library), op, [shape, shape[-1:], shape], 1, ())
    rows = int(np.prod(shape[:-1]))
    assert fields["grid"] == f"{-(-rows // 4)},{-(-shape[-1] // 1024)},1", fields
    assert int(fields["spec"]) == spec, fields


def test_mul_plan_refuses_up_of_another_shape(native_library):
    from tests.native_hooks import plan_attrs

    rc, msg = plan_attrs(load(native_library), "BiasGeluTanhMul", [(2, 3, 64), (64,), (2, 1, 64)], 1, ())
    assert rc != 0 and "input up has shape [2,1,64] but input X has shape [2,3,64]" in msg, msg


# ---- on the GPU: the Mul ops through ORT's CUDA EP and the library --------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("type_name", ["float", "float16", "bfloat16"])
@pytest.mark.parametrize("tanh", [False, True])
@pytest.mark.parametrize("shape", [(3, 37), (2, 5, 2048), (16, 8192)], ids=str)
def test_mul_ops_through_the_cuda_ep(gpu_library, shape, tanh, type_name):
    from ort_triton.ops.bias_gelu import BIAS_GELU_MUL, BIAS_GELU_TANH_MUL
    from tests.ops.test_rotary_kernel import ONNX_TYPES, _typed_op_model, run_on_cuda

    op = BIAS_GELU_TANH_MUL if tanh else BIAS_GELU_MUL
    rng = np.random.default_rng(sum(shape))
    torch_dtype = ONNX_TYPES[type_name][1]
    x, b, up = (torch.from_numpy(rng.normal(0, 2, s)).to(torch_dtype).float().numpy()
                for s in (shape, shape[-1:], shape))
    y = run_on_cuda(gpu_library, _typed_op_model(op, [shape, shape[-1:], shape], type_name),
                    {"X32": x, "bias32": b, "up32": up})
    (want,) = reference_bias_gelu_mul(x, b, up, tanh)
    assert y.shape == want.shape and np.abs(y - want).max() / np.abs(want).max() < TOL[torch_dtype]
