"""The LayerNorm kernel under Triton's interpreter on the CPU, against the float64 reference.

Odd hidden sizes (not multiples of 16, below and above block edges) and the sizes laid out in three blocks
(768, 1536, 3072), 1-D to 4-D inputs, all three dtypes, with and without the residual and the stored sum.
Outputs are poisoned with NaN before each run, so an element the kernel forgets to write fails the check.
"""

import os

import numpy as np
import pytest
import torch

from ort_triton.kernels.layer_norm import layer_norm
from ort_triton.ops.layer_norm import THIRDS, layout, reference_add_layer_norm, reference_layer_norm

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # conftest decides
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
SHAPES = [(7,), (3, 93), (2, 5, 64), (1, 1, 3, 257), (4, 1030), (2, 2049), (5, 768), (2, 3, 1536), (3072,)]


def _rand(shape, dtype, gen, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype).to(DEVICE)


def _check(name, got, want, dtype):
    got64 = got.to(torch.float64).cpu().numpy()
    assert np.isfinite(got64).all(), f"{name}: unwritten (NaN) or non-finite elements"
    err = np.abs(got64 - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < TOL[dtype], f"{name}: rel err {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["plain", "residual", "residual+sum"])
def test_matches_reference(dtype, shape, mode):
    gen = torch.Generator().manual_seed(hash((str(dtype), shape, mode)) % 2**31)
    h = shape[-1]
    # An offset mean (3.0) and a non-unit scale: a one-pass variance would lose digits here.
    x = _rand(shape, dtype, gen, 2.0, 3.0)
    skip = _rand(shape, dtype, gen) if mode != "plain" else None
    bias = _rand((h,), dtype, gen) if mode != "plain" else None
    gamma, beta = _rand((h,), dtype, gen, 0.5, 1.0), _rand((h,), dtype, gen)
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    sum_out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) if mode == "residual+sum" else None
    eps = 1e-5
    res = layer_norm(x, gamma, beta, skip, eps, store_sum=sum_out is not None, bias=bias, out=out, sum_out=sum_out)
    f = lambda t: t.to(torch.float64).cpu().numpy()
    if skip is None:
        (want,) = reference_layer_norm(f(x), f(gamma), f(beta), eps)
        _check("y", res, want, dtype)
    else:
        want, want_sum = reference_add_layer_norm(f(x), f(skip), f(bias), f(gamma), f(beta), eps)
        _check("y", res[0] if sum_out is not None else res, want, dtype)
        if sum_out is not None:
            _check("sum", res[1], want_sum, dtype)


@pytest.mark.parametrize("h", THIRDS)
def test_thirds_layout_matches_one_block(h):
    """H = 3 * 2^k runs as three full blocks; forcing the one-block layout (the tail masked) gives the same
    fp32 result up to rounding, with the sum stored, over a row count that leaves the last program short."""
    assert layout(h) == {"BLOCK_H": h // 3, "CHUNKS": 3}
    gen = torch.Generator().manual_seed(h)
    x, skip = _rand((5, h), torch.float32, gen, 2.0, 3.0), _rand((5, h), torch.float32, gen)
    bias, gamma, beta = (_rand((h,), torch.float32, gen) for _ in range(3))
    pow2 = {"BLOCK_H": 1 << (h - 1).bit_length(), "CHUNKS": 1}
    y3, s3 = layer_norm(x, gamma, beta, skip, store_sum=True, bias=bias, config=(2, 1))
    y1, s1 = layer_norm(x, gamma, beta, skip, store_sum=True, bias=bias, config=(2, 1), lay=pow2)
    torch.testing.assert_close(s3, s1, rtol=0, atol=0)
    torch.testing.assert_close(y3, y1, rtol=1e-6, atol=1e-6)


def test_launch_override_sets_few_and_many_rows(monkeypatch):
    from ort_triton.ops.layer_norm import FEW_ROWS, LAUNCH_ENV, launch_config

    monkeypatch.setenv(LAUNCH_ENV, '{"1024": {"residual": [4, 8], "few:residual": [8, 2]}}')
    assert launch_config(1024, True, n_rows=FEW_ROWS) == (8, 2)
    assert launch_config(1024, True, n_rows=FEW_ROWS + 1) == launch_config(1024, True) == (4, 8)
    assert launch_config(1024) == launch_config(1024, n_rows=1)  # plain: no few-rows entry was set
    monkeypatch.setenv(LAUNCH_ENV, '{"1000": {"residual": [4, 8]}}')
    with pytest.raises(ValueError, match="few:MODE"):
        launch_config(1024)


def test_layout_that_does_not_fit_is_refused():
    x = torch.zeros(2, 768, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        layer_norm(x, x[0], x[0], lay={"BLOCK_H": 512, "CHUNKS": 1})


def test_constant_row_gives_beta():
    """var = 0: y must be exactly beta (no NaN from 0/0)."""
    x = torch.full((3, 50), 7.25, device=DEVICE)
    gamma, beta = torch.randn(50, device=DEVICE), torch.randn(50, device=DEVICE)
    y = layer_norm(x, gamma, beta)
    torch.testing.assert_close(y, beta.expand(3, 50), rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad, err", [
    (dict(x=torch.zeros(2, 20000)), "hidden size 20000"),
    (dict(x=torch.zeros(2, 8, dtype=torch.float64)), "dtype"),
    (dict(gamma=torch.zeros(9)), "gamma"),
    (dict(skip=torch.zeros(3, 8)), "skip"),
])
def test_bad_input_is_a_clear_error(bad, err):
    args = dict(x=torch.zeros(2, 8), gamma=torch.ones(8), beta=torch.zeros(8), skip=None)
    args.update(bad)
    if "x" in bad and bad["x"].shape[-1] != 8:
        args["gamma"] = args["beta"] = torch.ones(bad["x"].shape[-1])
    with pytest.raises((ValueError, TypeError), match=err):
        layer_norm(args["x"], args["gamma"], args["beta"], args["skip"])


@pytest.mark.parametrize("evict", [False, True])
@pytest.mark.parametrize("h", [768, 1030])
def test_eviction_hints_change_no_bit(evict, h):
    """EVICT only hints the caches: the same bits as without it, poisoned outputs, a row count that leaves
    the last program short."""
    gen = torch.Generator().manual_seed(h)
    x, skip = _rand((11, h), torch.float32, gen, 2.0, 3.0), _rand((11, h), torch.float32, gen)
    bias, gamma, beta = (_rand((h,), torch.float32, gen) for _ in range(3))
    y0, s0 = layer_norm(x, gamma, beta, skip, store_sum=True, bias=bias, config=(2, 1), evict=False)
    out, sum_out = (torch.full((11, h), float("nan"), device=DEVICE) for _ in range(2))
    y, s = layer_norm(x, gamma, beta, skip, store_sum=True, bias=bias, config=(2, 1), evict=evict, out=out,
                      sum_out=sum_out)
    torch.testing.assert_close(s, s0, rtol=0, atol=0)
    torch.testing.assert_close(y, y0, rtol=0, atol=0)


def test_launch_override_takes_the_eviction_hints(monkeypatch):
    from ort_triton.ops.layer_norm import LAUNCH_ENV, launch_config, launch_evict

    assert launch_evict(4096, True, n_rows=4096) == 1 and launch_evict(4096, True, n_rows=65536) == 0
    monkeypatch.setenv(LAUNCH_ENV, '{"768": {"residual": [1, 1, 1]}}')
    assert launch_config(768, True, n_rows=65536) == (1, 1)
    assert launch_evict(768, True, n_rows=65536) == 1
    monkeypatch.setenv(LAUNCH_ENV, '{"768": {"residual": [1, 1, 1, 4224]}}')
    with pytest.raises(ValueError, match="warps, evict"):
        launch_config(768, True)


def test_tuned_spec_keeps_the_tables_eviction_hints():
    """A tuned config for 4096 x 4096 AddLayerNorm compiles with the EVICT the tuner timed it with (the
    table's, 1 up to FEW_ROWS rows), and without it past FEW_ROWS."""
    from ort_triton.ops import ADD_LAYER_NORM

    tuning = ADD_LAYER_NORM.tuning
    for n_rows, want in ((4096, 1), (65536, 0)):
        keys = tuning.keys("float16", [[n_rows, 4096]] * 2 + [[4096]] * 3, {})
        spec = tuning.spec("float16", tuning.bucket(keys), {"ROWS": 1, "num_warps": 8})
        assert spec.constexprs["EVICT"] == want and spec.constexprs["ROWS"] == 1


def test_eviction_hints_only_where_the_table_sets_them():
    """The launch table's third field reaches the compiled spec: AddLayerNorm at H=4096 up to FEW_ROWS rows
    compiles with EVICT=1, past them and with the sum with EVICT=0 (the native planner picks between them
    by the row key)."""
    from ort_triton.ops import ADD_LAYER_NORM
    from ort_triton.ops.layer_norm import FEW_ROWS

    def evict(store_sum, n_rows):
        spec = next(sp for sp in ADD_LAYER_NORM.specializations("float16")
                    if sp.keys[1] == (store_sum, store_sum) and sp.keys[2][0] == 1 and sp.keys[3] == (2049, 4096)
                    and sp.keys[4][0] <= n_rows <= sp.keys[4][1])
        return spec.constexprs["EVICT"]

    assert evict(0, 4096) == 1 and evict(0, FEW_ROWS) == 1
    assert evict(0, FEW_ROWS + 1) == 0 and evict(1, 4096) == 0
