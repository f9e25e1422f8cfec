"""The Triton kernel behind LayerNorm and AddLayerNorm (contract and maths: ort_triton/ops/layer_norm.py).

Kernels live apart from the contracts so that rewriting and serving need no Triton; only the AOT build,
the tests and the GPU checks import this module.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.layer_norm import MAX_HIDDEN, launch_config, launch_evict, layout
from ..ops.tune_space import layout_width


@triton.jit
def _load_sum(X, R, C, offs, cols, mask, col_ok, HAS_RES: tl.constexpr, EVICT: tl.constexpr):
    """One block of s = (X + bias) + skip (s = X without a residual) in fp32, masked elements 0. EVICT: the
    row streams, read once, leave L2 first ("evict_first"), the [H] vectors every program reads stay."""
    row_policy: tl.constexpr = "evict_first" if EVICT else ""
    vec_policy: tl.constexpr = "evict_last" if EVICT else ""
    x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy=row_policy).to(tl.float32)
    if HAS_RES:  # the order the exported graph adds them in
        # Both row streams are loaded before the bias: loaded after it, ptxas ran out of registers for
        # the skip at H=8192 and issued its loads a few at a time (0.93x ORT; the SASS showed it).
        r = tl.load(R + offs, mask=mask, other=0.0, eviction_policy=row_policy).to(tl.float32)
        c = tl.load(C + cols, mask=col_ok, other=0.0, eviction_policy=vec_policy).to(tl.float32)
        x = (x + c[None, :]) + r
    return x


@triton.jit
def _store_y(Y, W, B, offs, cols, mask, col_ok, d, rstd, EVICT: tl.constexpr):
    """One block of y = d * rstd * gamma + beta."""
    vec_policy: tl.constexpr = "evict_last" if EVICT else ""
    w = tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy=vec_policy).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0, eviction_policy=vec_policy).to(tl.float32)
    tl.store(Y + offs, (d * rstd[:, None] * w[None, :] + b[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_fwd(
    X, R, C, W, B, Y, S, n_rows, H, eps,
    HAS_RES: tl.constexpr, STORE_SUM: tl.constexpr, BLOCK_H: tl.constexpr, CHUNKS: tl.constexpr,
    ROWS: tl.constexpr, EVICT: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]  # int64: rows * H can pass 2^31
    # div_rn: `/` is the approximate fp32 division, which turns a constant row's mean into mean + 1 ulp
    # and its output into beta + (1 ulp * rstd); with round-to-nearest the row gives beta exactly.
    h = tl.full([], H, tl.float32)  # H may arrive as a plain 1 (Triton's JIT specialises ints equal to 1)
    if CHUNKS == 1:  # one block of BLOCK_H >= H columns, the tail masked
        col_ok = cols < H
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        x = _load_sum(X, R, C, offs, cols, mask, col_ok, HAS_RES, EVICT)
        if STORE_SUM:
            tl.store(S + offs, x.to(S.dtype.element_ty), mask=mask)
        mean = tl.div_rn(tl.sum(x, axis=1), h)
        d = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt_rn(tl.div_rn(tl.sum(d * d, axis=1), h) + eps)
        _store_y(Y, W, B, offs, cols, mask, col_ok, d, rstd, EVICT)
    else:  # CHUNKS == 3: H = 3 * BLOCK_H, three full blocks, every lane busy
        col_ok = cols < BLOCK_H  # all true: the vectors need no mask
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        # All three blocks are loaded before anything is stored, so no load waits behind a store.
        x0 = _load_sum(X, R, C, offs, cols, mask, col_ok, HAS_RES, EVICT)
        x1 = _load_sum(X, R, C, offs + BLOCK_H, cols + BLOCK_H, mask, col_ok, HAS_RES, EVICT)
        x2 = _load_sum(X, R, C, offs + 2 * BLOCK_H, cols + 2 * BLOCK_H, mask, col_ok, HAS_RES, EVICT)
        if STORE_SUM:
            tl.store(S + offs, x0.to(S.dtype.element_ty), mask=mask)
            tl.store(S + offs + BLOCK_H, x1.to(S.dtype.element_ty), mask=mask)
            tl.store(S + offs + 2 * BLOCK_H, x2.to(S.dtype.element_ty), mask=mask)
        mean = tl.div_rn(tl.sum(x0, axis=1) + tl.sum(x1, axis=1) + tl.sum(x2, axis=1), h)
        # rows past n_rows hold the bias alone: their d is finite and never stored
        d0, d1, d2 = x0 - mean[:, None], x1 - mean[:, None], x2 - mean[:, None]
        var = tl.div_rn(tl.sum(d0 * d0, axis=1) + tl.sum(d1 * d1, axis=1) + tl.sum(d2 * d2, axis=1), h)
        rstd = 1.0 / tl.sqrt_rn(var + eps)
        _store_y(Y, W, B, offs, cols, mask, col_ok, d0, rstd, EVICT)
        _store_y(Y, W, B, offs + BLOCK_H, cols + BLOCK_H, mask, col_ok, d1, rstd, EVICT)
        _store_y(Y, W, B, offs + 2 * BLOCK_H, cols + 2 * BLOCK_H, mask, col_ok, d2, rstd, EVICT)


# ---- a torch entry point: the same kernel through Triton's JIT (tests, interpreter, GPU timing) -------
def layer_norm(x, gamma, beta, skip=None, epsilon=1e-5, store_sum=False, *, bias=None, out=None, sum_out=None,
               config: tuple[int, int] | None = None, lay: dict | None = None, evict: bool | None = None):
    """Run the kernel on torch tensors; returns y, or (y, sum) when store_sum. `out`/`sum_out` let a test
    hand in poisoned buffers; `config` = (ROWS, num_warps) overrides launch_config (tuning), `lay` the
    layout constexprs (a sweep comparing layouts); `evict` the kernel's EVICT (launch_evict's when not
    given)."""
    import torch

    h = x.shape[-1]
    if x.dim() < 1 or not 1 <= h <= MAX_HIDDEN:
        raise ValueError(f"layer_norm: hidden size {h} not supported (1..{MAX_HIDDEN})")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"layer_norm: dtype {x.dtype} not supported (float32, float16, bfloat16)")
    for name, t, shape in (("gamma", gamma, (h,)), ("beta", beta, (h,)), ("bias", bias, (h,)),
                           ("skip", skip, tuple(x.shape)),
                           ("out", out, tuple(x.shape)), ("sum_out", sum_out, tuple(x.shape))):
        if t is not None and (tuple(t.shape) != shape or t.dtype != x.dtype or not t.is_contiguous()):
            raise ValueError(f"layer_norm: {name} must be contiguous {x.dtype} of shape {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)}")
    if (store_sum or bias is not None) and skip is None:
        raise ValueError("layer_norm: store_sum and bias need skip (they belong to AddLayerNorm)")
    x, gamma, beta = x.contiguous(), gamma.contiguous(), beta.contiguous()
    skip = skip.contiguous() if skip is not None else None
    n_rows = x.numel() // h
    lay = lay or layout(h)
    width = layout_width(lay)
    if width < h or (lay["CHUNKS"] != 1 and width != h):  # three blocks are full: no tail mask
        raise ValueError(f"layer_norm: layout {lay} does not fit H={h}")
    rows, warps = config or launch_config(width, skip is not None, store_sum, n_rows=n_rows)
    evict = launch_evict(width, skip is not None, store_sum, n_rows=n_rows) if evict is None else evict
    y = out if out is not None else torch.empty_like(x)
    s = (sum_out if sum_out is not None else torch.empty_like(x)) if store_sum else None
    layer_norm_fwd[(triton.cdiv(n_rows, rows),)](
        # R and C are read only with a residual: without one, any valid pointer does
        x, skip if skip is not None else x,
        bias if bias is not None else (torch.zeros_like(gamma) if skip is not None else gamma), gamma, beta, y,
        s if s is not None else y, n_rows, h, epsilon,
        HAS_RES=skip is not None, STORE_SUM=store_sum, **lay, ROWS=rows, EVICT=int(evict), num_warps=warps,
    )
    return (y, s) if store_sum else y
