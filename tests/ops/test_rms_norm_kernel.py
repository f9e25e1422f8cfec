"""The RMSNorm kernel under Triton's interpreter on the CPU, against the float64 reference.

Odd hidden sizes (not multiples of 16, below and above block edges), row counts that leave a tile of
ROWS rows partly empty, 1-D to 4-D inputs, all three dtypes, with and without the residual and the
stored sum. Outputs are poisoned with NaN before each run, so an element the kernel forgets to write
fails the check.
"""

import os

import numpy as np
import pytest
import torch

from ort_triton.kernels.rms_norm import rms_norm
from ort_triton.ops.rms_norm import BLOCKS, launch_config, reference_add_rms_norm, reference_rms_norm

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # conftest decides
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# (19, 100): three tiles of 8 rows (block 256), the last one 3 rows full; (4, 1030) and (2, 2049) cross a
# block edge; (5, 1) is the H the JIT specialises as a constant; (3, 2048) and (520, 1040) take block 2048's
# few-rows and many-rows launch configs (ops/rms_norm.py FEW_ROWS).
SHAPES = [(37,), (3, 37), (19, 100), (1, 1, 3, 257), (4, 1030), (2, 2049), (5, 1), (3, 2048), (520, 1040)]


def _rand(shape, dtype, gen, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype).to(DEVICE)


def _f64(t):
    return t.to(torch.float64).cpu().numpy()


def _check(name, got, want, dtype):
    got64 = _f64(got)
    assert np.isfinite(got64).all(), f"{name}: unwritten (NaN) or non-finite elements"
    err = np.abs(got64 - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < TOL[dtype], f"{name}: rel err {err:.2e} > {TOL[dtype]:.0e}"


def _nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["plain", "residual", "residual+sum"])
def test_matches_reference(dtype, shape, mode):
    gen = torch.Generator().manual_seed(hash((str(dtype), shape, mode)) % 2**31)
    h = shape[-1]
    x = _rand(shape, dtype, gen, 2.0, 0.5)
    skip = _rand(shape, dtype, gen) if mode != "plain" else None
    gamma = _rand((h,), dtype, gen, 0.5, 1.0)
    out = _nan(shape, dtype)
    sum_out = _nan(shape, dtype) if mode == "residual+sum" else None
    eps = 1e-6
    res = rms_norm(x, gamma, skip, eps, store_sum=sum_out is not None, out=out, sum_out=sum_out)
    if skip is None:
        (want,) = reference_rms_norm(_f64(x), _f64(gamma), eps)
        _check("y", res, want, dtype)
    else:
        want, want_sum = reference_add_rms_norm(_f64(x), _f64(skip), _f64(gamma), eps)
        _check("y", res[0] if sum_out is not None else res, want, dtype)
        if sum_out is not None:
            _check("sum", res[1], want_sum, dtype)
            # the stored sum is the element type's own rounded add, exactly (what the graph's Add gives)
            assert torch.equal(res[1].cpu(), (x + skip).cpu())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounds_the_sum_then_once_at_the_end(dtype):
    """The contract's rounding order for 16-bit types: sum rounded to T, everything after in fp32, one
    rounding of Y. An emulation of exactly that agrees to within an fp32 ulp before the final rounding,
    so at most one T ulp where the fp32 value sits on a rounding boundary; almost all elements are equal."""
    gen = torch.Generator().manual_seed(7)
    x, skip = _rand((6, 300), dtype, gen, 3.0), _rand((6, 300), dtype, gen, 3.0)
    gamma = _rand((300,), dtype, gen, 0.5, 1.0)
    y = rms_norm(x, gamma, skip, 1e-5, out=_nan((6, 300), dtype))
    s = (x + skip).float()
    want = (s * torch.rsqrt((s * s).mean(-1, keepdim=True) + 1e-5) * gamma.float()).to(dtype)
    diff = (y.float() - want.float()).abs()
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert (diff <= ulp).all() and (y != want).float().mean() < 0.02


def test_large_fp16_inputs_do_not_overflow():
    """Values near fp16's max (65504): their squares (~4e9) overflow fp16 but not the fp32 reduction."""
    gen = torch.Generator().manual_seed(3)
    h = 1030
    x = (torch.rand((4, h), generator=gen, dtype=torch.float64) * 2 - 1) * 6.5e4
    x[:, :5] = 6.0e4
    x = x.to(torch.float16).to(DEVICE)
    gamma = _rand((h,), torch.float16, gen, 0.5, 1.0)
    for skip in (None, torch.zeros_like(x)):
        y = rms_norm(x, gamma, skip, 1e-6, out=_nan((4, h), torch.float16))
        (want,) = reference_rms_norm(_f64(x), _f64(gamma), 1e-6)
        _check("y", y, want, torch.float16)


def test_zero_row_gives_zero():
    """ms = 0: y = 0 * rsqrt(eps) * gamma = 0 exactly, no NaN."""
    x = torch.zeros((3, 50), device=DEVICE)
    y = rms_norm(x, torch.randn(50, device=DEVICE), out=_nan((3, 50), torch.float32))
    assert torch.equal(y, torch.zeros_like(x))


def test_launch_config_override_still_correct():
    """`config` (the tuning hook) with other ROWS / warps than the table's gives the same result."""
    gen = torch.Generator().manual_seed(5)
    x, gamma = _rand((9, 70), torch.float32, gen), _rand((70,), torch.float32, gen)
    base = rms_norm(x, gamma)
    assert launch_config(BLOCKS[0]) != (2, 1)
    # equal up to fp32 summation order (another tile splits the row's sum of squares differently on a GPU)
    torch.testing.assert_close(rms_norm(x, gamma, config=(2, 1), out=_nan((9, 70), torch.float32)), base,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad, err", [
    (dict(x=torch.zeros(2, 20000)), "hidden size 20000"),
    (dict(x=torch.zeros(2, 8, dtype=torch.float64)), "dtype"),
    (dict(gamma=torch.zeros(9)), "gamma"),
    (dict(skip=torch.zeros(3, 8)), "skip"),
    (dict(store_sum=True), "store_sum needs skip"),
])
def test_bad_input_is_a_clear_error(bad, err):
    args = dict(x=torch.zeros(2, 8), gamma=torch.ones(8), skip=None, store_sum=False)
    args.update(bad)
    if "x" in bad:
        args["gamma"] = torch.ones(bad["x"].shape[-1])
    with pytest.raises((ValueError, TypeError), match=err):
        rms_norm(args["x"], args["gamma"], args["skip"], store_sum=args["store_sum"])
