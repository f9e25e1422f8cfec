"""The Triton kernel behind BiasGelu and BiasGeluTanh (contract and maths: ort_triton/ops/bias_gelu.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.bias_gelu import BLOCK_H, NUM_WARPS, ROWS

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_RSQRT2 = tl.constexpr(0.7071067811865476)


@triton.jit
def gelu(s, TANH: tl.constexpr):
    """gelu(s) of fp32 s, the erf form or the tanh one (also the epilogue of kernels/linear.py)."""
    if TANH:
        z = _SQRT_2_OVER_PI * (s + 0.044715 * s * s * s)
        # tanh(z) = 1 - 2 / (exp(2z) + 1): exact at both ends (exp overflows to inf -> 1, underflows -> -1)
        t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
    else:
        t = tl.math.erf(s * _RSQRT2)
    return 0.5 * s * (1.0 + t)


@triton.jit
def bias_gelu_fwd(X, B, Y, n_rows, H, TANH: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    s = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    s += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, gelu(s, TANH).to(Y.dtype.element_ty), mask=mask)


def bias_gelu(x, bias, tanh=False, *, out=None):
    """Run the kernel on torch tensors (tests, the interpreter, GPU timing)."""
    import torch

    h = x.shape[-1]
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"bias_gelu: dtype {x.dtype} not supported (float32, float16, bfloat16)")
    if tuple(bias.shape) != (h,) or bias.dtype != x.dtype:
        raise ValueError(f"bias_gelu: bias must be {x.dtype} of shape [{h}], got {bias.dtype} {list(bias.shape)}")
    x = x.contiguous()
    y = out if out is not None else torch.empty_like(x)
    n_rows = x.numel() // h if h else 0
    grid = (triton.cdiv(n_rows, ROWS), triton.cdiv(h, BLOCK_H))
    bias_gelu_fwd[grid](x, bias.contiguous(), y, n_rows, h, TANH=tanh, BLOCK_H=BLOCK_H, ROWS=ROWS,
                        num_warps=NUM_WARPS)
    return y
