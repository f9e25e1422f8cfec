"""The Triton kernel behind RMSNorm and AddRMSNorm (contract and maths: ort_triton/ops/rms_norm.py).

    s  = T(X + skip)                          (HAS_RES; stored when STORE_SUM)
    ms = sum(float(s)^2) / H                  one pass over registers, fp32
    Y  = T(float(s) * (1 / sqrt(ms + eps)) * float(gamma))

Kernels live apart from the contracts so that rewriting and serving need no Triton; only the AOT build,
the tests and the GPU checks import this module.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.rms_norm import BLOCKS, MAX_HIDDEN, launch_config


@triton.jit
def rms_norm_fwd(
    X, R, W, Y, S, n_rows, H, eps,
    HAS_RES: tl.constexpr, STORE_SUM: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]  # int64: rows * H can pass 2^31
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the element type before it is normalised: the graph's Add rounds it, the
        # residual stream carries the rounded value on, and Y must be RMSNorm of exactly that value.
        s = (x + r).to(X.dtype.element_ty)
        if STORE_SUM:
            tl.store(S + offs, s, mask=mask)
        x = s.to(tl.float32)
    # Masked columns hold 0 and add nothing to the sum of squares. fp32 squares do not overflow for any
    # fp16/bf16 input (65504^2 * 16384 ~ 7e13), which an fp16 Pow in the exported graph would.
    h = tl.full([], H, tl.float32)  # H may arrive as a plain 1 (Triton's JIT specialises ints equal to 1)
    ms = tl.div_rn(tl.sum(x * x, axis=1), h)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))  # per row, so the exact division costs nothing
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


# ---- a torch entry point: the same kernel through Triton's JIT (tests, interpreter, GPU timing) -------
def rms_norm(x, gamma, skip=None, epsilon=1e-6, store_sum=False, *, out=None, sum_out=None,
             config: tuple[int, int] | None = None):
    """Run the kernel on torch tensors; returns y, or (y, sum) when store_sum. `out`/`sum_out` let a test
    hand in poisoned buffers; `config` = (ROWS, num_warps) overrides launch_config (tuning)."""
    import torch

    h = x.shape[-1] if x.dim() >= 1 else 0
    if not 1 <= h <= MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {h} not supported (1..{MAX_HIDDEN})")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"rms_norm: dtype {x.dtype} not supported (float32, float16, bfloat16)")
    for name, t, shape in (("gamma", gamma, (h,)), ("skip", skip, tuple(x.shape)),
                           ("out", out, tuple(x.shape)), ("sum_out", sum_out, tuple(x.shape))):
        if t is not None and (tuple(t.shape) != shape or t.dtype != x.dtype or not t.is_contiguous()):
            raise ValueError(f"rms_norm: {name} must be contiguous {x.dtype} of shape {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)}")
    if store_sum and skip is None:
        raise ValueError("rms_norm: store_sum needs skip (it belongs to AddRMSNorm)")
    x, gamma = x.contiguous(), gamma.contiguous()
    n_rows = x.numel() // h
    block = next(b for b in BLOCKS if b >= h)
    rows, warps = config or launch_config(block, skip is not None, store_sum, n_rows=n_rows)
    y = out if out is not None else torch.empty_like(x)
    s = (sum_out if sum_out is not None else torch.empty_like(x)) if store_sum else None
    rms_norm_fwd[(triton.cdiv(n_rows, rows),)](
        # R is read only with a residual, S written only with STORE_SUM: otherwise any valid pointer does
        x, skip if skip is not None else x, gamma, y, s if s is not None else y, n_rows, h, epsilon,
        HAS_RES=skip is not None, STORE_SUM=store_sum, BLOCK_H=block, ROWS=rows, num_warps=warps,
    )
    return (y, s) if store_sum else y
