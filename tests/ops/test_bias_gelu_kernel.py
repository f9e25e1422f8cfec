"""The BiasGelu kernel (both forms) against the float64 reference, poisoned outputs, odd widths (tails of
the 1024-wide column blocks, H not a multiple of 16), several row counts; under the interpreter on CPU."""

import os

import numpy as np
import pytest
import torch

from ort_triton.kernels.bias_gelu import bias_gelu
from ort_triton.ops.bias_gelu import reference_bias_gelu

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 5, 1030), (9, 2048), (4, 3072)], ids=str)
@pytest.mark.parametrize("tanh", [False, True])
def test_matches_reference(dtype, shape, tanh):
    gen = torch.Generator().manual_seed(sum(shape) + tanh)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype).to(DEVICE)
    b = torch.randn(shape[-1], generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    y = bias_gelu(x, b, tanh, out=out).double().cpu().numpy()
    (want,) = reference_bias_gelu(x.double().cpu().numpy(), b.double().cpu().numpy(), tanh)
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
