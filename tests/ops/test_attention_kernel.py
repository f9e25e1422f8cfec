"""The MultiHeadAttention kernel under Triton's interpreter on the CPU (natively on a GPU), against the float64
reference.

Every head dim the library holds, all three dtypes, query/key lengths that are not multiples of the blocks
(1, 7, 33, 65, Sq != Skv) with blocks shrunk to 16 so that several key blocks and a masked tail run;
padding masks of both kinds the contract defines (finfo.min and -inf), fully masked rows, Skv = 0. Outputs
are poisoned with NaN before each run, so an element the kernel forgets to write fails the check.
"""

import os

import numpy as np
import pytest
import torch

from ort_triton.kernels.attention import attention, packed_attention
from ort_triton.ops.attention import HEAD_DIMS, reference_attention
from ort_triton.ops.packed_attention import reference_packed_attention

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # conftest decides
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
SMALL = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4)  # several query and key blocks at tiny lengths


def _inputs(b, sq, skv, heads, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(shape, generator=gen, dtype=torch.float64)
    # scores of a few units, so the softmax is neither flat nor one-hot
    q, k, v = r(b, sq, heads * d), r(b, skv, heads * d), r(b, skv, heads * d)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v)]


def _run(q, k, v, kb, heads, scale, config=None, biases=(None, None)):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    y = attention(q, k, v, kb, heads, scale, k_bias=biases[0], v_bias=biases[1], out=out, config=config)
    assert y is out
    return y.to(torch.float64).cpu().numpy()


def _f64(t):
    return t.to(torch.float64).cpu().numpy()


def _check(got, q, k, v, kb, heads, scale, dtype, biases=(None, None)):
    zero = np.zeros(q.shape[-1])
    (want,) = reference_attention(_f64(q), _f64(k), _f64(v), _f64(kb),
                                  *(zero if c is None else _f64(c) for c in biases), heads, scale)
    _assert_close(got, want, dtype)
    return want


def _assert_close(got, want, dtype):
    assert np.isfinite(got).all(), "unwritten (NaN) or non-finite elements"
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < TOL[dtype], f"rel err {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_every_head_dim_with_its_library_blocks(dtype, d):
    """The block_config the library compiles (one query block, one partial key block here)."""
    b, sq, skv, heads = 2, 5, 9, 2
    q, k, v = _inputs(b, sq, skv, heads, d, dtype, seed=d)
    kb = torch.zeros(b, skv, dtype=dtype, device=DEVICE)
    _check(_run(q, k, v, kb, heads, d**-0.5), q, k, v, kb, heads, d**-0.5, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sq, skv", [(1, 1), (7, 33), (33, 7), (65, 65), (1, 65), (33, 16)])
@pytest.mark.parametrize("d", [40, 64])
def test_odd_lengths_over_several_blocks(dtype, sq, skv, d):
    heads = 2
    q, k, v = _inputs(2, sq, skv, heads, d, dtype, seed=sq * 100 + skv)
    kb = (torch.rand(2, skv, generator=torch.Generator().manual_seed(skv)) - 0.5).to(dtype).to(DEVICE)
    # a large scale sharpens the softmax: the running max must really be tracked across blocks
    scale = 1.5 * d**-0.5
    _check(_run(q, k, v, kb, heads, scale, SMALL), q, k, v, kb, heads, scale, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", ["finfo.min", "-inf"])
def test_padding_masks_and_fully_masked_rows(dtype, masked):
    """Per batch row a random window of valid keys (left and right padding, so whole key blocks are masked
    before the first valid one), and one row with no key left."""
    b, sq, skv, heads, d = 5, 19, 50, 2, 32
    q, k, v = _inputs(b, sq, skv, heads, d, dtype, seed=7)
    gen = np.random.default_rng(3)
    low = torch.finfo(dtype).min if masked == "finfo.min" else float("-inf")
    kb = torch.full((b, skv), low, dtype=torch.float64)
    windows = [(0, skv), (0, 1), (20, 31), (33, 50), None]  # the last row: fully masked
    for i, w in enumerate(windows):
        if w:
            kb[i, w[0]:w[1]] = torch.from_numpy(gen.uniform(-1, 1, w[1] - w[0]))
    kb = kb.to(dtype).to(DEVICE)
    got = _run(q, k, v, kb, heads, d**-0.5, SMALL)
    want = _check(got, q, k, v, kb, heads, d**-0.5, dtype)
    full = got[-1]
    if masked == "-inf":  # the contract: a row with every key at -inf is 0
        assert (full == 0).all()
    elif dtype != torch.float16:
        # the contract: finfo.min on every key gives uniform weights, the mean of V's rows. (fp16's
        # finfo.min, -65504, is only a shift of the scores in fp32 and float64: there the row is the plain
        # softmax, and equal to the reference above.)
        mean = v[-1].to(torch.float64).mean(0).cpu().numpy()
        assert np.abs(full - mean[None, :]).max() < TOL[dtype] * np.abs(mean).max()
    assert np.abs(full - want[-1]).max() <= TOL[dtype] * max(np.abs(want).max(), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", ["finfo.min", "-inf"])
def test_projection_biases(dtype, masked):
    """k_bias and v_bias against the reference, which adds both; the kernel drops k_bias (it cancels in
    the softmax) and adds v_bias to rows that saw a key. The last batch row is fully masked:
    with -inf it stays 0 (no v_bias), with finfo.min it is the mean of V + v_bias."""
    b, sq, skv, heads, d = 3, 21, 37, 2, 40
    q, k, v = _inputs(b, sq, skv, heads, d, dtype, seed=11)
    gen = torch.Generator().manual_seed(5)
    biases = tuple((torch.randn(heads * d, generator=gen, dtype=torch.float64) * 2).to(dtype).to(DEVICE)
                   for _ in range(2))
    low = torch.finfo(dtype).min if masked == "finfo.min" else float("-inf")
    kb = torch.zeros(b, skv, dtype=torch.float64)
    kb[1, 30:] = low
    kb[2, :] = low
    kb = kb.to(dtype).to(DEVICE)
    got = _run(q, k, v, kb, heads, d**-0.5, SMALL, biases)
    _check(got, q, k, v, kb, heads, d**-0.5, dtype, biases)
    if masked == "-inf":
        assert (got[-1] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_keys_gives_zero(dtype):
    """Skv = 0: the function body's MatMul over an empty axis gives 0, and so does the kernel."""
    q, k, v = _inputs(2, 3, 0, 1, 32, dtype, seed=0)
    kb = torch.zeros(2, 0, dtype=dtype, device=DEVICE)
    assert (_run(q, k, v, kb, 1, 0.1) == 0).all()


def test_empty_batch_and_empty_queries_launch_nothing():
    for b, sq in ((0, 4), (2, 0)):
        q, k, v = _inputs(b, sq, 3, 2, 32, torch.float32, seed=0)
        y = attention(q, k, v, torch.zeros(b, 3, device=DEVICE), 2, 0.1)
        assert y.shape == q.shape


def test_non_contiguous_inputs_are_copied():
    q, k, v = _inputs(2, 6, 5, 1, 32, torch.float32, seed=1)
    kt = k.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not contiguous
    kb = torch.zeros(2, 5, device=DEVICE)
    assert not kt.is_contiguous()
    _check(_run(q, kt, v, kb, 1, 0.2), q, k, v, kb, 1, 0.2, torch.float32)


def _args(**over):
    q = torch.zeros(2, 3, 64, device=DEVICE)
    args = dict(q=q, k=torch.zeros(2, 5, 64, device=DEVICE), v=torch.zeros(2, 5, 64, device=DEVICE),
                key_bias=torch.zeros(2, 5, device=DEVICE), num_heads=1, scale=0.125)
    args.update(over)
    return args


@pytest.mark.parametrize("over, err", [
    (dict(q=torch.zeros(2, 3, 64, dtype=torch.float64)), "dtype torch.float64 not supported"),
    (dict(q=torch.zeros(3, 64)), r"q must be \[B, Sq, N\*D\]"),
    (dict(num_heads=3), "num_heads=3 must be a positive int dividing the hidden size 64"),
    (dict(num_heads=0), "num_heads=0"),
    (dict(q=torch.zeros(2, 3, 12), num_heads=1), r"head dim 12 .* not supported \(head dims 32, 40, 64"),
    (dict(k=torch.zeros(2, 5, 32)), r"k must be \[B=2, Skv, 64\]"),
    (dict(k=torch.zeros(1, 5, 64)), r"k must be \[B=2, Skv, 64\]"),
    (dict(v=torch.zeros(2, 4, 64)), r"v must be .* shape \[2, 5, 64\]"),
    (dict(v=torch.zeros(2, 5, 64, dtype=torch.float16)), "v must be torch.float32"),
    (dict(key_bias=torch.zeros(2, 4)), r"key_bias must be .* shape \[2, 5\]"),
    (dict(key_bias=torch.zeros(2, 1, 1, 5)), r"key_bias must be .* shape \[2, 5\]"),
    (dict(k_bias=torch.zeros(1, 64)), r"k_bias must be .* shape \[64\]"),
    (dict(v_bias=torch.zeros(64, dtype=torch.float16)), r"v_bias must be torch.float32"),
])
def test_bad_input_is_a_clear_error(over, err):
    if DEVICE != "cpu":
        over = {n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in over.items()}
    with pytest.raises((ValueError, TypeError), match=err):
        attention(**_args(**over))


def test_bad_out_is_a_clear_error():
    with pytest.raises(ValueError, match=r"out must be .* shape \[2, 3, 64\]"):
        attention(**_args(), out=torch.zeros(2, 3, 32, device=DEVICE))


@pytest.mark.gpu
def test_offsets_past_2_31_elements():
    """int64 offsets: Q, K, V and Y hold 2^31 + 2^16 elements each (4.3 GB in fp16) and the last batch row
    starts at element 2^31; B * N = 524304 programs also pass grid.y's 65535."""
    b, s, heads, d = 32769, 64, 16, 64
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(b, s, heads * d, device=DEVICE, dtype=torch.float16, generator=gen) for _ in range(3))
    kb = torch.zeros(b, s, device=DEVICE, dtype=torch.float16)
    kb[-1, 40:] = torch.finfo(torch.float16).min
    y = attention(q, k, v, kb, heads, d**-0.5)
    for i in (0, b - 1):
        got = y[i:i + 1].double().cpu().numpy()
        _check(got, q[i:i + 1], k[i:i + 1], v[i:i + 1], kb[i:i + 1], heads, d**-0.5, torch.float16)


# ---- PackedMultiHeadAttention: Q, K, V side by side in one [B, S, 3*N*D] projection, with its bias -------
def _packed_inputs(b, s, heads, d, dtype, seed, bias_scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, 3 * heads * d, generator=gen, dtype=torch.float64)
    bias = torch.randn(3 * heads * d, generator=gen, dtype=torch.float64) * bias_scale
    return qkv.to(dtype).to(DEVICE), bias.to(dtype).to(DEVICE)


def _check_packed(qkv, kb, bias, heads, scale, dtype, config=SMALL):
    out = torch.full((*qkv.shape[:2], qkv.shape[2] // 3), float("nan"), dtype=dtype, device=DEVICE)
    assert packed_attention(qkv, kb, bias, heads, scale, out=out, config=config) is out
    got = _f64(out)
    (want,) = reference_packed_attention(_f64(qkv), _f64(kb), _f64(bias), heads, scale)
    _assert_close(got, want, dtype)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_packed_every_head_dim_with_its_library_blocks(dtype, d):
    """The library's blocks; every bias nonzero (Q's is staged into Q, K's cancels, V's is added)."""
    qkv, bias = _packed_inputs(2, 9, 2, d, dtype, seed=d)
    kb = torch.zeros(2, 9, dtype=dtype, device=DEVICE)
    _check_packed(qkv, kb, bias, 2, d**-0.5, dtype, config=None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s", [1, 7, 33, 65])
@pytest.mark.parametrize("d", [40, 64])
def test_packed_odd_lengths_over_several_blocks(dtype, s, d):
    qkv, bias = _packed_inputs(2, s, 3, d, dtype, seed=s)
    kb = (torch.rand(2, s, generator=torch.Generator().manual_seed(s)) - 0.5).to(dtype).to(DEVICE)
    _check_packed(qkv, kb, bias, 3, 1.5 * d**-0.5, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", ["finfo.min", "-inf"])
def test_packed_padding_and_fully_masked_rows(dtype, masked):
    """Right padding on one row, every key masked on the last: -inf gives 0 (no v_bias), finfo.min the
    mean of V + v_bias (not fp16, whose finfo.min only shifts the scores: see the unpacked test)."""
    b, s, heads, d = 3, 37, 2, 32
    qkv, bias = _packed_inputs(b, s, heads, d, dtype, seed=13)
    low = torch.finfo(dtype).min if masked == "finfo.min" else float("-inf")
    kb = torch.zeros(b, s, dtype=torch.float64)
    kb[1, 30:] = low
    kb[2, :] = low
    got = _check_packed(qkv, kb.to(dtype).to(DEVICE), bias, heads, d**-0.5, dtype)
    hidden = heads * d
    if masked == "-inf":
        assert (got[-1] == 0).all()
    elif dtype != torch.float16:
        v = qkv[-1, :, 2 * hidden:].to(torch.float64) + bias[2 * hidden:].to(torch.float64)
        mean = v.mean(0).cpu().numpy()
        assert np.abs(got[-1] - mean[None, :]).max() < TOL[dtype] * np.abs(mean).max()


def test_packed_empty_batch_launches_nothing():
    qkv, bias = _packed_inputs(0, 4, 2, 32, torch.float32, seed=0)
    y = packed_attention(qkv, torch.zeros(0, 4, device=DEVICE), bias, 2, 0.1)
    assert y.shape == (0, 4, 64)


@pytest.mark.parametrize("over, err", [
    (dict(qkv=torch.zeros(2, 3, 64)), r"num_heads=1 must be a positive int dividing the hidden size 21 "
                                      r"\(dim 2 is 64: Q, K, V side by side\)"),
    (dict(qkv=torch.zeros(3, 192)), r"qkv must be \[B, S, 3\*N\*D\]"),
    (dict(qkv=torch.zeros(2, 3, 36)), r"head dim 12 \(hidden 12 / 1 heads\) not supported"),
    (dict(key_bias=torch.zeros(2, 4)), r"key_bias must be .* shape \[2, 3\]"),
    (dict(bias=torch.zeros(64)), r"bias must be .* shape \[192\]"),
    (dict(out=torch.zeros(2, 3, 192)), r"out must be .* shape \[2, 3, 64\]"),
])
def test_packed_bad_input_is_a_clear_error(over, err):
    args = dict(qkv=torch.zeros(2, 3, 192), key_bias=torch.zeros(2, 3), bias=torch.zeros(192), num_heads=1,
                scale=0.125)
    args.update(over)
    args = {n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    with pytest.raises((ValueError, TypeError), match=err):
        packed_attention(**args)
