"""The Triton kernel behind BiasGelu and BiasGeluTanh (contract and maths: ort_triton/ops/bias_gelu.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.bias_gelu import BLOCK_H, NUM_WARPS, ROWS

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_RSQRT2 = tl.constexpr(0.7071067811865476)


@triton.jit
def _erfc(a):
    """erfc(a) for a >= 0: Numerical Recipes' Chebyshev fit t * exp(-a^2 + P(t)), t = 1 / (1 + a/2), whose
    relative error is under 1.2e-7 for every a. One exp, one (approximate) reciprocal and nine FMAs."""
    t = 1.0 / (1.0 + 0.5 * a)
    p = 0.17087277
    p = p * t - 0.82215223
    p = p * t + 1.48851587
    p = p * t - 1.13520398
    p = p * t + 0.27886807
    p = p * t - 0.18628806
    p = p * t + 0.09678418
    p = p * t + 0.37409196
    p = p * t + 1.00002368
    p = p * t - 1.26551223
    return t * tl.exp(p - a * a)


@triton.jit
def gelu(s, TANH: tl.constexpr):
    """gelu(s) of fp32 s, the erf form or the tanh one (also the epilogue of kernels/linear.py).

    The erf form goes through erfc: with c = erfc(|s| / sqrt(2)), 1 + erf(s / sqrt(2)) is 2 - c for s >= 0
    and c for s < 0. Why not libdevice's erff: on the H200 it made BiasGelu compute-bound, 73 us at
    16384 x 3072 fp16 against 51 us for the bias add alone, 68 us through erfc
    (bench/results/session8/bias_gelu_micro_*.jsonl);
    and 1 + erf(x) cancels for x << 0, so the old form lost every digit of gelu's negative tail (relative
    error 1.1 at s = -5.6 in fp32), where this one keeps 2e-6 for |s| < 4 and 2e-5 out to s = -13."""
    if TANH:
        z = _SQRT_2_OVER_PI * (s + 0.044715 * s * s * s)
        # tanh(z) = 1 - 2 / (exp(2z) + 1): exact at both ends (exp overflows to inf -> 1, underflows -> -1)
        t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
        return 0.5 * s * (1.0 + t)
    c = _erfc(tl.abs(s) * _RSQRT2)
    # s * (1 - c/2) keeps s = +inf at inf (c = 0); s = -inf gives NaN, as the function body's -inf * 0 does
    return tl.where(s >= 0, s * (1.0 - 0.5 * c), 0.5 * s * c)


@triton.jit
def _bias_gelu_rows(X, B, U, Y, n_rows, H, TANH: tl.constexpr, MUL: tl.constexpr, BLOCK_H: tl.constexpr,
                    ROWS: tl.constexpr):
    # one (ROWS x BLOCK_H) tile: y = gelu(x + bias) (MUL: times up, U), fp32 inside, rounded once
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    s = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    s += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = gelu(s, TANH)
    if MUL:
        y = y * tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_fwd(X, B, Y, n_rows, H, TANH: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    """BiasGelu, BiasGeluTanh (U: X, never read)."""
    _bias_gelu_rows(X, B, X, Y, n_rows, H, TANH, False, BLOCK_H, ROWS)


@triton.jit
def bias_gelu_mul_fwd(X, B, U, Y, n_rows, H, TANH: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    """BiasGeluMul, BiasGeluTanhMul."""
    _bias_gelu_rows(X, B, U, Y, n_rows, H, TANH, True, BLOCK_H, ROWS)


def bias_gelu(x, bias, tanh=False, *, out=None, up=None):
    """Run the kernel on torch tensors (tests, the interpreter, GPU timing); with `up` (x's shape and type), the
    Mul ops' kernel, gelu(x + bias) * up."""
    import torch

    h = x.shape[-1]
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"bias_gelu: dtype {x.dtype} not supported (float32, float16, bfloat16)")
    if tuple(bias.shape) != (h,) or bias.dtype != x.dtype:
        raise ValueError(f"bias_gelu: bias must be {x.dtype} of shape [{h}], got {bias.dtype} {list(bias.shape)}")
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype):
        raise ValueError(f"bias_gelu: up must be x's shape {list(x.shape)} and type {x.dtype}, got {up.dtype} "
                         f"{list(up.shape)}")
    x = x.contiguous()
    y = out if out is not None else torch.empty_like(x)
    n_rows = x.numel() // h if h else 0
    grid = (triton.cdiv(n_rows, ROWS), triton.cdiv(h, BLOCK_H))
    blocks = dict(TANH=tanh, BLOCK_H=BLOCK_H, ROWS=ROWS, num_warps=NUM_WARPS)
    if up is None:
        bias_gelu_fwd[grid](x, bias.contiguous(), y, n_rows, h, **blocks)
    else:
        bias_gelu_mul_fwd[grid](x, bias.contiguous(), up.contiguous(), y, n_rows, h, **blocks)
    return y
