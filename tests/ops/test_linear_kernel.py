"""The Triton linear kernel (the GEMM candidate that bench/linear.py times against cuBLAS) against a float64
reference: poisoned outputs, M, N, K not multiples of the tiles, every epilogue and every bench config's
tiling logic (small blocks on CPU under the interpreter, the real candidates on the GPU)."""

import os

import numpy as np
import pytest
import torch

from ort_triton.kernels.linear import CONFIGS, linear
from ort_triton.ops.bias_gelu import reference_bias_gelu

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
# the interpreter is slow at big tiles: its configs keep the candidates' shapes of logic (grouping, EVEN_K
# or not, a 16-row tile) at small sizes
SMALL = [(16, 16, 16, 1, 1, 1), (32, 16, 16, 2, 1, 1), (16, 32, 32, 4, 1, 1)]
CONFIGS_HERE = SMALL if DEVICE == "cpu" else list(CONFIGS)


def _reference(x, w, b, activation):
    s = x.double().cpu().numpy() @ w.double().cpu().numpy() + (0 if b is None else b.double().cpu().numpy())
    return s if activation == "none" else reference_bias_gelu(s, np.zeros(s.shape[1]), activation == "gelu_tanh")[0]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("mkn", [(1, 16, 16), (5, 48, 40), (37, 96, 33), (64, 100, 64)], ids=str)
@pytest.mark.parametrize("activation", ["none", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("config", CONFIGS_HERE, ids=str)
def test_matches_reference(dtype, mkn, activation, config):
    m, k, n = mkn
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    w = (torch.randn(k, n, generator=gen, dtype=torch.float64) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE) if activation != "none" or m % 2 \
        else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    y = linear(x, w, b, activation, out=out, config=config).double().cpu().numpy()
    want = _reference(x, w, b, activation)
    assert np.isfinite(y).all(), "unwritten elements"
    err = np.abs(y - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < TOL[dtype], err


def test_empty_and_bad_inputs():
    x = torch.zeros(0, 16, dtype=torch.float16, device=DEVICE)
    assert linear(x, torch.zeros(16, 8, dtype=torch.float16, device=DEVICE)).shape == (0, 8)
    with pytest.raises(ValueError, match="x must be"):
        linear(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(7, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        linear(torch.zeros(2, 8), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="activation"):
        linear(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(8, 4, dtype=torch.float16), activation="relu")
