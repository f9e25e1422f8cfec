"""The warp-specialised attention kernel (kernels/attention.py `_attention_ws`, the WS configs `ort-triton tune`
offers on Hopper) under Triton's interpreter on the CPU, natively on a GPU, against the float64 reference.

Its tiles come through TMA descriptors, so what the pointer kernel masks is done differently here: rows past
a batch's S load as zeros, keys past SKV get bias -inf by index, and a key block can be all padding. The cases:
every head dim it takes (32, 64, 128), both forms (packed at 32 and 64), fp16 and bf16; lengths that leave a
partial query block and a partial key block (S = 16, 144 over 128-row and 64/128-key tiles), Sq != Skv, batches
whose rows would spill into the next batch's if the boxes were not per batch; padding of both kinds the
contract defines, key blocks wholly masked before the first valid key, fully masked rows. Outputs are
poisoned with NaN first. Under the interpreter the warp specialisation itself is not run (it is a compiler
pass): the GPU run of this file covers it.
"""

import os

import numpy as np
import pytest
import torch

from ort_triton.kernels.attention import attention, packed_attention
from ort_triton.ops.attention import WS_ENV, WS_HEAD_DIMS, reference_attention, ws_enabled
from ort_triton.ops.packed_attention import reference_packed_attention

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # conftest decides
# natively only with the experimental kernel asked for (ops/attention.py `ws_enabled`: its first launch on the
# H200 did not return); the interpreter runs its maths either way
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not ws_enabled(), reason=f"{WS_ENV} is not 1")
DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


def ws(block_n=64, stages=2):
    return dict(BLOCK_M=128, BLOCK_N=block_n, num_warps=4, num_stages=stages, WS=True)


def _randn(gen, *shape):
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _f64(t):
    return t.to(torch.float64).cpu().numpy()


def _assert_close(got, want, dtype):
    assert np.isfinite(got).all(), "unwritten (NaN) or non-finite elements"
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < TOL[dtype], f"rel err {err:.2e} > {TOL[dtype]:.0e}"


def _key_bias(b, skv, dtype, masked, windows, seed):
    """[B, SKV]: per batch row a window of valid keys with small random biases, `masked` elsewhere; a window
    of None masks the whole row."""
    gen = np.random.default_rng(seed)
    low = torch.finfo(dtype).min if masked == "finfo.min" else float("-inf")
    kb = torch.full((b, skv), low, dtype=torch.float64)
    for i, w in enumerate(windows):
        if w:
            kb[i, w[0]:w[1]] = torch.from_numpy(gen.uniform(-1, 1, w[1] - w[0]))
    return kb.to(dtype).to(DEVICE)


def _run_mha(q, k, v, kb, heads, scale, v_bias, config):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    assert attention(q, k, v, kb, heads, scale, v_bias=v_bias, out=out, config=config) is out
    return _f64(out)


def _check_mha(b, sq, skv, heads, d, dtype, kb, config, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (_randn(gen, b, s, heads * d).to(dtype).to(DEVICE) for s in (sq, skv, skv))
    v_bias = (_randn(gen, heads * d) * 2).to(dtype).to(DEVICE)
    got = _run_mha(q, k, v, kb, heads, d**-0.5, v_bias, config)
    (want,) = reference_attention(_f64(q), _f64(k), _f64(v), _f64(kb), np.zeros(heads * d), _f64(v_bias), heads,
                                  d**-0.5)
    _assert_close(got, want, dtype)
    return got, v, v_bias


def _check_packed(b, s, heads, d, dtype, kb, config, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = _randn(gen, b, s, 3 * heads * d).to(dtype).to(DEVICE)
    bias = (_randn(gen, 3 * heads * d) * 2).to(dtype).to(DEVICE)
    out = torch.full((b, s, heads * d), float("nan"), dtype=dtype, device=DEVICE)
    assert packed_attention(qkv, kb, bias, heads, d**-0.5, out=out, config=config) is out
    got = _f64(out)
    (want,) = reference_packed_attention(_f64(qkv), _f64(kb), _f64(bias), heads, d**-0.5)
    _assert_close(got, want, dtype)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", WS_HEAD_DIMS)
@pytest.mark.parametrize("s, block_n", [(16, 64), (144, 128), (144, 64)])
def test_every_head_dim(dtype, d, s, block_n):
    """One partial query block (S = 16 of 128 rows), or a full key block and a partial one (144 keys)."""
    kb = (torch.rand(3, s, generator=torch.Generator().manual_seed(s)) - 0.5).to(dtype).to(DEVICE)
    _check_mha(3, s, s, 2, d, dtype, kb, ws(block_n), seed=d + s)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sq, skv", [(16, 160), (160, 32)])
def test_queries_and_keys_of_different_lengths(dtype, sq, skv):
    kb = torch.zeros(2, skv, dtype=dtype, device=DEVICE)
    _check_mha(2, sq, skv, 3, 64, dtype, kb, ws(64, stages=3), seed=sq + skv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", ["finfo.min", "-inf"])
def test_padding_and_fully_masked_rows(dtype, masked):
    """Right and left padding (the first two 64-key blocks of row 2 are all padding), one valid key, and a row
    with no key left: -inf gives 0 (no v_bias), finfo.min the mean of V + v_bias (not fp16, whose finfo.min only
    shifts the scores: the reference's plain softmax then)."""
    b, s, heads, d = 5, 160, 2, 32
    kb = _key_bias(b, s, dtype, masked, [(0, s), (0, 1), (130, 160), (0, 100), None], seed=3)
    got, v, v_bias = _check_mha(b, s, s, heads, d, dtype, kb, ws(64), seed=7)
    if masked == "-inf":
        assert (got[-1] == 0).all()
    elif dtype != torch.float16:
        mean = (_f64(v[-1]).mean(0) + _f64(v_bias))[None, :]
        assert np.abs(got[-1] - mean).max() < TOL[dtype] * np.abs(mean).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [d for d in WS_HEAD_DIMS if d != 128])
@pytest.mark.parametrize("masked", ["finfo.min", "-inf"])
def test_packed(dtype, d, masked):
    """Q's bias added in registers, K's dropped, V's added; padding and a fully masked row."""
    b, s, heads = 3, 144, 2
    kb = _key_bias(b, s, dtype, masked, [(0, s), (0, 70), None], seed=d)
    got = _check_packed(b, s, heads, d, dtype, kb, ws(128), seed=d)
    if masked == "-inf":
        assert (got[-1] == 0).all()


@pytest.mark.parametrize("change, err", [
    (dict(skv=40), "key counts that are multiples of 16"),
    (dict(d=40), "head dims 32, 64, 128"),
    (dict(dtype=torch.float32), "got float, head dim"),
])
def test_what_it_does_not_take_is_a_clear_error(change, err):
    p = dict(skv=48, d=64, dtype=torch.float16) | change
    q = torch.zeros(1, 16, 2 * p["d"], dtype=p["dtype"], device=DEVICE)
    kv = torch.zeros(1, p["skv"], 2 * p["d"], dtype=p["dtype"], device=DEVICE)
    kb = torch.zeros(1, p["skv"], dtype=p["dtype"], device=DEVICE)
    with pytest.raises(ValueError, match=err):
        attention(q, kv, kv, kb, 2, 0.1, config=ws())


def test_packed_head_dim_128_is_refused():
    """Triton 3.6's warp-specialisation pass fails on it: the kernel says so before compiling."""
    qkv = torch.zeros(1, 16, 3 * 256, dtype=torch.float16, device=DEVICE)
    kb = torch.zeros(1, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="not packed at 128"):
        packed_attention(qkv, kb, torch.zeros(3 * 256, dtype=torch.float16, device=DEVICE), 2, 0.1, config=ws())
