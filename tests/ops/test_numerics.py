"""Numerical edge cases for every kernel, against the float64 references (ops/*.py): NaN and Inf in the
inputs land where the reference puts them (its result stored in the kernel's type, so an overflow is inf
there too), and fp16 inputs near the overflow limit stay finite where the reductions run in fp32.

Under Triton's interpreter on the CPU; natively on CUDA in the GPU check (scripts/gpu_check.sh runs
tests/ops). Outputs are poisoned before each run: an element the kernel forgets is NaN where the reference
has a number, and fails.
"""

import os

import numpy as np
import pytest
import torch

from ort_triton.kernels.attention import attention
from ort_triton.kernels.bias_gelu import bias_gelu
from ort_triton.kernels.causal_attention import causal_attention
from ort_triton.kernels.embed_layer_norm import embed_layer_norm
from ort_triton.kernels.layer_norm import layer_norm
from ort_triton.kernels.linear import linear
from ort_triton.kernels.rms_norm import rms_norm
from ort_triton.kernels.rotary import rotary
from ort_triton.kernels.swiglu import silu_mul
from ort_triton.ops.attention import reference_attention
from ort_triton.ops.bias_gelu import reference_bias_gelu
from ort_triton.ops.causal_attention import reference_causal_attention
from ort_triton.ops.embed_layer_norm import reference_embed_layer_norm
from ort_triton.ops.layer_norm import reference_add_layer_norm, reference_layer_norm
from ort_triton.ops.rms_norm import reference_rms_norm
from ort_triton.ops.rotary import reference_rotary
from ort_triton.ops.swiglu import reference_silu_mul

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # conftest decides
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
NAN, INF = float("nan"), float("inf")


def _t(a, dtype):
    return torch.as_tensor(np.asarray(a, np.float64)).to(dtype).to(DEVICE)


def _f64(t):
    return t.to(torch.float64).cpu().numpy()


def _poison(shape, dtype):
    return torch.full(shape, 12345.0, dtype=dtype, device=DEVICE)  # a number no kernel here writes


def _same(got, want, dtype):
    """NaN, +inf and -inf exactly where the reference, stored in `dtype`, has them; the rest within TOL of
    the largest finite reference value."""
    got = _f64(got)
    want = torch.as_tensor(np.asarray(want, np.float64)).to(dtype).to(torch.float64).numpy()
    assert got.shape == want.shape
    for what, f in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        bad = f(got) != f(want)
        assert not bad.any(), f"{what} differs from the reference at {np.argwhere(bad)[:5].tolist()}"
    fin = np.isfinite(want)
    if fin.any():
        err = np.abs(got[fin] - want[fin]).max() / max(np.abs(want[fin]).max(), 1e-6)
        assert err < TOL[dtype], f"rel err {err:.2e} > {TOL[dtype]:.0e}"


def _rows(rng, n, h, specials=True):
    """[n, h] normal values; with specials, row 1 holds a NaN, row 2 a +inf, row 3 a -inf (rows 0 and 4+
    stay finite and must stay untouched by their neighbours)."""
    x = rng.normal(size=(n, h))
    if specials:
        x[1, h // 2], x[2, 0], x[3, h - 1] = NAN, INF, -INF
    return x


# ---- row-wise norms ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h", [37, 768])
@pytest.mark.parametrize("mode", ["plain", "residual", "residual+sum"])
def test_layer_norm_specials(dtype, h, mode):
    rng = np.random.default_rng(h)
    x, g, b = _rows(rng, 6, h), rng.normal(1, 0.2, h), rng.normal(0, 0.2, h)
    if mode == "plain":
        y = layer_norm(_t(x, dtype), _t(g, dtype), _t(b, dtype), out=_poison((6, h), dtype))
        _same(y, reference_layer_norm(x, g, b)[0], dtype)
        return
    skip, bias = rng.normal(size=(6, h)), rng.normal(0, 0.2, h)
    skip[4, 3] = NAN  # a special in the skip only: its row
    store = mode == "residual+sum"
    got = layer_norm(_t(x, dtype), _t(g, dtype), _t(b, dtype), _t(skip, dtype), store_sum=store,
                     bias=_t(bias, dtype), out=_poison((6, h), dtype),
                     sum_out=_poison((6, h), dtype) if store else None)
    want_y, want_s = reference_add_layer_norm(x, skip, bias, g, b)
    _same(got[0] if store else got, want_y, dtype)
    if store:
        _same(got[1], want_s, dtype)


@pytest.mark.parametrize("h", [37, 768, 4096])
def test_layer_norm_fp16_near_the_overflow_limit(h):
    """Values up to 6.5e4: the squares (~4e9) overflow fp16, not the fp32 reduction; a row of equal values
    has variance 0 and gives beta."""
    rng = np.random.default_rng(h)
    x = rng.uniform(-6.5e4, 6.5e4, (4, h))
    x[2] = 6.0e4
    g, b = rng.normal(1, 0.2, h), rng.normal(0, 0.2, h)
    y = layer_norm(_t(x, torch.float16), _t(g, torch.float16), _t(b, torch.float16), out=_poison((4, h), torch.float16))
    _same(y, reference_layer_norm(_f64(_t(x, torch.float16)), g, b)[0], torch.float16)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_specials(dtype, residual):
    rng = np.random.default_rng(5)
    h = 100
    x, g = _rows(rng, 6, h), rng.normal(1, 0.2, h)
    skip = rng.normal(size=(6, h)) if residual else None
    y = rms_norm(_t(x, dtype), _t(g, dtype), None if skip is None else _t(skip, dtype), 1e-6,
                 out=_poison((6, h), dtype))
    _same(y, reference_rms_norm(x if skip is None else x + skip, g, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embed_layer_norm_specials(dtype):
    """A NaN or an inf in a table row spoils exactly the tokens that read it."""
    rng = np.random.default_rng(7)
    h, v = 48, 10
    word, types, pos = rng.normal(size=(v, h)), rng.normal(size=(2, h)), rng.normal(size=(8, h))
    word[3, 5], word[4, 0], pos[6, 7] = NAN, INF, -INF
    ids = np.array([[3, 1, 4, 2, 0, 9, 5, 3], [0, 1, 2, 5, 6, 7, 8, 9]])
    tt, pp = np.zeros((2, 8), np.int64), np.arange(8)[None, :]
    g, b = rng.normal(1, 0.2, h), rng.normal(0, 0.2, h)
    ti = lambda a: torch.as_tensor(np.asarray(a, np.int64)).to(DEVICE)  # noqa: E731
    y = embed_layer_norm(ti(ids), ti(tt), ti(pp), _t(word, dtype), _t(types, dtype), _t(pos, dtype), _t(g, dtype),
                         _t(b, dtype), 1e-12, out=_poison((2, 8, h), dtype))
    _same(y, reference_embed_layer_norm(ids, tt, pp, word, types, pos, g, b, 1e-12)[0], dtype)


# ---- element-wise -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tanh", [False, True])
def test_bias_gelu_specials(dtype, tanh):
    """NaN stays NaN; +inf gives inf; -inf gives NaN, as the graph's -inf * 0 does (ops/bias_gelu.py)."""
    rng = np.random.default_rng(9)
    x, bias = rng.normal(0, 3, (5, 70)), rng.normal(0, 0.5, 70)
    x[0, :6] = [NAN, INF, -INF, 1e5, -1e5, 0.0]
    y = bias_gelu(_t(x, dtype), _t(bias, dtype), tanh, out=_poison((5, 70), dtype))
    _same(y, reference_bias_gelu(_f64(_t(x, dtype)), _f64(_t(bias, dtype)), tanh)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_specials(dtype):
    rng = np.random.default_rng(11)
    gate, up = rng.normal(0, 3, (4, 90)), rng.normal(size=(4, 90))
    gate[0, :4], up[1, :3] = [NAN, INF, -INF, -1e4], [NAN, INF, -INF]
    y = silu_mul(_t(gate, dtype), _t(up, dtype), out=_poison((4, 90), dtype))
    _same(y, reference_silu_mul(_f64(_t(gate, dtype)), _f64(_t(up, dtype)))[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_specials(dtype, interleaved):
    """A special in x reaches the two outputs of its pair (and only them)."""
    rng = np.random.default_rng(13)
    b, n, s, d = 1, 2, 5, 32
    x = rng.normal(size=(b, n, s, d))
    x[0, 0, 1, 3], x[0, 1, 2, 20], x[0, 1, 4, 0] = NAN, INF, -INF
    ang = rng.uniform(0.1, 1.4, (b, s, d // 2))  # cos, sin > 0: inf * 0 never happens
    cos, sin = np.cos(ang), np.sin(ang)
    y = rotary(_t(x, dtype), _t(cos, dtype), _t(sin, dtype), interleaved, out=_poison((b, n, s, d), dtype))
    _same(y, reference_rotary(x, _f64(_t(cos, dtype)), _f64(_t(sin, dtype)), interleaved)[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ["none", "gelu"])
def test_linear_specials(dtype, act):
    """A NaN in a row of x spoils that output row; an inf gives +-inf by the weights' signs (no zero weight),
    or NaN after GELU's -inf; the bias's NaN spoils its column."""
    rng = np.random.default_rng(15)
    m, k, n = 37, 40, 24
    x, w, bias = rng.normal(size=(m, k)), rng.uniform(0.1, 1.0, (k, n)), rng.normal(size=n)
    w *= rng.choice([-1.0, 1.0], size=(k, n))
    x[3, 7], x[10, 0] = NAN, INF
    bias[5] = NAN
    y = linear(_t(x, dtype), _t(w, dtype), _t(bias, dtype), act, out=_poison((m, n), dtype))
    xs, ws, bs = (_f64(_t(a, dtype)) for a in (x, w, bias))
    want = xs @ ws + bs
    if act == "gelu":
        want = reference_bias_gelu(want, np.zeros(n))[0]
    _same(y, want, dtype)


# ---- attention --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_specials(dtype):
    """A NaN in one query spoils that query's row of its head; a NaN in one key or value spoils every row of
    its batch and head (every query sees it); an inf in a value row gives +-inf in that column wherever its
    weight is nonzero (fp16/bf16; fp32 runs its dots in 3xTF32, whose split of inf is inf - inf = NaN, so
    there only the NaN cases are checked). Other batches and heads are untouched."""
    rng = np.random.default_rng(17)
    b, s, n, d = 3, 19, 2, 32
    q, k, v = (rng.normal(size=(b, s, n * d)) for _ in range(3))
    q[0, 4, 5] = NAN  # batch 0, head 0, query 4
    k[1, 7, d + 1] = NAN  # batch 1, head 1
    if dtype != torch.float32:
        v[2, 3, 2] = INF  # batch 2, head 0, column 2
    kb = np.zeros((b, s))
    zeros = np.zeros(n * d)
    y = attention(_t(q, dtype), _t(k, dtype), _t(v, dtype), _t(kb, dtype), n, d**-0.5,
                  out=_poison((b, s, n * d), dtype))
    want = reference_attention(*(_f64(_t(a, dtype)) for a in (q, k, v)), kb, zeros, zeros, n, d**-0.5)[0]
    _same(y, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_attention_specials(dtype):
    """A NaN in key j spoils the queries that see j (j <= position) and no other."""
    rng = np.random.default_rng(19)
    b, nq, nkv, s, t, d = 2, 4, 2, 9, 13, 32
    q, k, v = rng.normal(size=(b, nq, s, d)), rng.normal(size=(b, nkv, t, d)), rng.normal(size=(b, nkv, t, d))
    k[0, 1, 8, 3] = NAN  # batch 0, KV head 1 (query heads 2, 3), key 8: queries at positions 8.. see it
    q[1, 0, 2, 0] = NAN
    kb = np.zeros((b, t))
    y = causal_attention(_t(q, dtype), _t(k, dtype), _t(v, dtype), _t(kb, dtype), d**-0.5,
                         out=_poison((b, s, nq * d), dtype))
    want = reference_causal_attention(*(_f64(_t(a, dtype)) for a in (q, k, v)), kb, d**-0.5)[0]
    _same(y, want, dtype)
