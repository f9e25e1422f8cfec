"""The kernel behind AddRMSNormLinear and AddRMSNormSwiGLU (contracts and maths: ort_triton/ops/norm_linear.py).

One function, three modes. FUSED (a constexpr) picks MODE 0 or the steps; MODE (a runtime argument) picks between
the steps, so one compiled steps spec serves both, and neither kind of spec carries the other's code (the fused
product's registers made the steps spec spill 400-530 bytes, session 26):

    MODE 0, fused (M <= BLOCK_M rows, grid = ceil(N / BLOCK_N)):
        s = T(x + skip), rstd = 1 / sqrt(mean(s^2) + eps) per row (a first pass over K; program 0 writes s),
        n = T(s * rstd * gamma), then acc[j, m] = sum_k WT[j, k] * n[m, k] (and acc2 with WT2 for SwiGLU):
        Y = T(acc), or Y = T(silu(T(acc)) * T(acc2)).
    MODE 1, the norm alone (more rows; grid = M, one row a program in ROW_BLOCK chunks): n into NB [M, K], s into S.
    MODE 2, SwiGLU alone (grid = ceil(M * N / (BLOCK_M * BLOCK_N)), a flat block of elements a program):
        Y = T(silu(GB) * UB), GB and UB [M, N] the two GEMMs cuBLAS ran on NB between the launches.

The steps' loads are 16-byte vectors only where Triton can prove the addresses aligned and the mask constant over
each vector. An AOT spec knows no integer argument's divisibility unless it declares it (the JIT specialises on it
unasked), and a mask `offs < bound` with a bound of unknown divisibility is constant over one element only. So MODE
1's rows (starting at pid * K, masked at K) have a spec for K % 16 == 0 that declares K so, and MODE 2 walks [M, N] as
one flat array, its whole blocks unmasked, whatever N is. Session 27's steps had neither: the model's profile
(session 28, H100, Llama-1B 1x512) had them at 237-293 us over 16 layers, where the graph's norm and SiluMul took 160.

Why tl.dot for a product of 1-16 rows: the weight is the MMA's A operand (BLOCK_N of its rows, K contiguous as
WT is stored) and the few rows of n, padded to BLOCK_M = 16, its B operand. Triton's pipeliner then stages the
weight tiles in shared memory num_stages deep (cp.async): the bytes in flight a decode product needs, which the
register loop of gemv.py has to arrange by hand. The MMA's wasted rows cost nothing: the product is memory-bound.

Rounding follows the unfused graph: the Add rounds s to T, AddRMSNorm rounds n once, cuBLAS rounds each GEMM's
fp32 sum once, SiluMul computes in fp32 from the rounded gate and up and rounds once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemv import _dot, _weight_tile  # Linear's skinny product: the same loads and MMA, with a prologue here
from .pdl import pdl_start, prefetch_rows


@triton.jit
def _sum_tile(X, R, offs, ok, T):
    """s = T(x + skip) for one [BLOCK_M, BLOCK_K] tile, in fp32 (masked elements 0)."""
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(R + offs, mask=ok, other=0.0).to(tl.float32)
    return (x + r).to(T).to(tl.float32)


@triton.jit
def _rstd(X, R, S, rows, m_ok, K, eps, store_sum, T, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(s^2) + eps) for each row, writing s where store_sum."""
    ks = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, K, BLOCK_K):
        ok = m_ok[:, None] & (k + ks < K)[None, :]
        offs = rows.to(tl.int64)[:, None] * K + (k + ks)[None, :]
        s = _sum_tile(X, R, offs, ok, T)
        tl.store(S + offs, s.to(T), mask=ok & (store_sum != 0))
        ss += tl.sum(s * s, axis=1)
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, tl.full([], K, tl.float32)) + eps))


@triton.jit
def _rstd_one_row(X, R, S, K, eps, store_sum, T, ROW_BLOCK: tl.constexpr):
    """_rstd of the one row at X, R (S: where its sum goes) in 1-D chunks of ROW_BLOCK, a scalar: K = 2048 is one
    chunk, one round trip to memory. The [BLOCK_M, BLOCK_K] loop would take K / BLOCK_K dependent ones: before the
    weight streams at a decode step of batch 1 (session 24, H100: Llama's norm + Q/K/V 11.2 us that way, 9.1 us this
    way), and in MODE 1, where 16 rows a program in [16, 128] tiles made Llama-1B's prefill 1x512 0.72x (session 26)."""
    ks = tl.arange(0, ROW_BLOCK)
    ss = tl.zeros([ROW_BLOCK], tl.float32)
    for k in range(0, K, ROW_BLOCK):
        ok = k + ks < K
        s = _sum_tile(X, R, k + ks, ok, T)
        tl.store(S + k + ks, s.to(T), mask=ok & (store_sum != 0))
        ss += s * s
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(ss, axis=0), tl.full([], K, tl.float32)) + eps))


@triton.jit
def _silu_mul(g, u):
    """silu(g) * u in fp32 (g << 0: exp(-g) = inf, g / inf = -0, no NaN), as SiluMul."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def norm_linear_fwd(
    X, R, G, WT, WT2, Y, S, NB, GB, UB, M, N, K, eps, store_sum, MODE,
    FUSED: tl.constexpr, SWIGLU: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr, PDL: tl.constexpr = 0,
):
    T = Y.dtype.element_ty
    pid = tl.program_id(0)
    if FUSED:  # MODE 0
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K  # clamped: a valid row, not stored
        prefetch_rows(WT + w_rows, K, 2 * BLOCK_K, PDL)  # the weights' first two tiles, while the kernel before runs
        if SWIGLU:
            prefetch_rows(WT2 + w_rows, K, 2 * BLOCK_K, PDL)
        pdl_start(PDL)
        ks = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, BLOCK_M)
        m_ok = rows < M
        # only program 0 writes the sum; every program needs rstd (M x K from L2, the weight is far more). Rows
        # past M hold rstd 1 over zeros: finite, never stored.
        if M == 1:
            rstd = tl.full([BLOCK_M], 1.0, tl.float32) * _rstd_one_row(X, R, S, K, eps, store_sum * (pid == 0), T,
                                                                       ROW_BLOCK)
        else:
            rstd = _rstd(X, R, S, rows, m_ok, K, eps, store_sum * (pid == 0), T, BLOCK_M, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k in range(0, K, BLOCK_K):  # pipelined num_stages deep (the spec's): the loads feed tl.dot
            k_ok = k + ks < K
            offs = rows[:, None] * K + (k + ks)[None, :]
            s = _sum_tile(X, R, offs, m_ok[:, None] & k_ok[None, :], T)
            g = tl.load(G + k + ks, mask=k_ok, other=0.0).to(tl.float32)
            n = (s * rstd[:, None] * g[None, :]).to(T)
            acc = _dot(_weight_tile(WT + w_rows + (k + ks)[None, :], k_ok, EVEN_K), n, acc)
            if SWIGLU:
                acc2 = _dot(_weight_tile(WT2 + w_rows + (k + ks)[None, :], k_ok, EVEN_K), n, acc2)
        if SWIGLU:
            acc = _silu_mul(acc.to(T).to(tl.float32), acc2.to(T).to(tl.float32))
        out = rows[None, :].to(tl.int64) * N + cols[:, None]
        tl.store(Y + out, acc.to(T), mask=(cols < N)[:, None] & m_ok[None, :])
    else:  # the steps
        pdl_start(PDL)
        if MODE == 1:  # row pid: its sum (re-read from X and R, in L1/L2 by now) times rstd and gamma
            row = pid.to(tl.int64) * K
            rstd = _rstd_one_row(X + row, R + row, S + row, K, eps, store_sum, T, ROW_BLOCK)
            cs = tl.arange(0, ROW_BLOCK)
            for k in range(0, K, ROW_BLOCK):
                ok = k + cs < K
                s = _sum_tile(X + row, R + row, k + cs, ok, T)
                g = tl.load(G + k + cs, mask=ok, other=0.0).to(tl.float32)
                tl.store(NB + row + k + cs, (s * rstd * g).to(T), mask=ok)
        else:
            start = pid.to(tl.int64) * (BLOCK_M * BLOCK_N)
            offs = start + tl.arange(0, BLOCK_M * BLOCK_N)
            total = tl.full([], M, tl.int64) * N  # M may arrive as a plain 1 (the JIT specialises it)
            if start + BLOCK_M * BLOCK_N <= total:  # a whole block, unmasked: 16-byte vectors whatever N is
                g = tl.load(GB + offs).to(tl.float32)
                u = tl.load(UB + offs).to(tl.float32)
                tl.store(Y + offs, _silu_mul(g, u).to(T))
            else:  # the last block
                ok = offs < total
                g = tl.load(GB + offs, mask=ok, other=0.0).to(tl.float32)
                u = tl.load(UB + offs, mask=ok, other=0.0).to(tl.float32)
                tl.store(Y + offs, _silu_mul(g, u).to(T), mask=ok)


# ---- a torch entry point: the same kernel through Triton's JIT (tests, interpreter, GPU timing) -------
def norm_linear(x, skip, gamma, wt, wt2=None, epsilon=1e-6, store_sum=False, *, out=None, sum_out=None,
                block_n=64, block_k=128, stages=3, num_warps=4, row_block=2048, fused=None):
    """Y (and the sum when store_sum) for X [..., K], skip like X, gamma [K], wt (and wt2) [N, K]. `fused`: True
    runs MODE 0 (at most 16 rows), False MODE 1, torch.matmul on the normed rows, and MODE 2 for SwiGLU (what the
    library runs beyond 16 rows, torch's GEMM standing in for cuBLAS); None picks by the row count."""
    import torch

    k, n = x.shape[-1], wt.shape[0]
    if tuple(wt.shape) != (n, k) or (wt2 is not None and tuple(wt2.shape) != (n, k)):
        raise ValueError(f"norm_linear: weights must be [N, K] with K = {k}, got {list(wt.shape)}"
                         + ("" if wt2 is None else f" and {list(wt2.shape)}"))
    x2, r2 = x.reshape(-1, k).contiguous(), skip.reshape(-1, k).contiguous()
    m = x2.shape[0]
    fused = m <= 16 if fused is None else fused
    y = out if out is not None else x.new_empty(*x.shape[:-1], n)
    s = (sum_out if sum_out is not None else torch.empty_like(x)) if store_sum else y
    args = dict(SWIGLU=wt2 is not None, EVEN_K=k % block_k == 0, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                ROW_BLOCK=row_block, num_warps=num_warps, num_stages=stages)
    w2 = wt if wt2 is None else wt2
    if fused:
        if m > 16:
            raise ValueError(f"norm_linear: the fused mode takes at most 16 rows, got {m}")
        norm_linear_fwd[(triton.cdiv(n, block_n),)](x2, r2, gamma, wt, w2, y, s, y, y, y, m, n, k, epsilon,
                                                      int(store_sum), 0, FUSED=1, **args)
    else:
        nb = x2.new_empty(m, k)
        norm_linear_fwd[(m,)](x2, r2, gamma, wt, w2, y, s, nb, y, y, m, n, k, epsilon, int(store_sum), 1, FUSED=0,
                              **args)
        if wt2 is None:
            torch.matmul(nb, wt.t(), out=y.view(m, n))
        else:
            gb, ub = nb @ wt.t(), nb @ wt2.t()
            grid = (triton.cdiv(m * n, 16 * block_n),)
            norm_linear_fwd[grid](x2, r2, gamma, wt, w2, y, s, nb, gb, ub, m, n, k, epsilon, 0, 2, FUSED=0, **args)
    return (y, s) if store_sum else y
