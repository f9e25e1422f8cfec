"""The Triton kernel behind SiluMul (contract and maths: ort_triton/ops/swiglu.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.swiglu import BLOCK_I, NUM_WARPS, ROWS


@triton.jit
def silu_mul_fwd(G, U, Y, n_rows, n_cols, BLOCK_I: tl.constexpr, ROWS: tl.constexpr):
    # y = g * sigmoid(g) * u = g / (1 + exp(-g)) * u, in fp32; g << 0: exp(-g) = inf, y = -0 * u (no NaN
    # unless u is inf or NaN, as in the unfused graph)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]  # rows * I passes int32 for long batches
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate, up, *, out=None):
    """Run the kernel on torch tensors (tests, the interpreter, GPU timing)."""
    import torch

    if gate.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"silu_mul: dtype {gate.dtype} not supported (float32, float16, bfloat16)")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() < 1:
        raise ValueError(f"silu_mul: gate and up must be one shape and type, got {gate.dtype} {list(gate.shape)} "
                         f"and {up.dtype} {list(up.shape)}")
    gate, up = gate.contiguous(), up.contiguous()
    y = out if out is not None else torch.empty_like(gate)
    width = gate.shape[-1]
    n_rows = gate.numel() // width if width else 0
    grid = (triton.cdiv(n_rows, ROWS), triton.cdiv(width, BLOCK_I))
    if n_rows and width:
        silu_mul_fwd[grid](gate, up, y, n_rows, width, BLOCK_I=BLOCK_I, ROWS=ROWS, num_warps=NUM_WARPS)
    return y
