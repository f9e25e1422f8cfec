"""Linear's kernel for a decode step's few rows: Y[M, N] = X[M, K] @ W[K, N] with the weight held transposed,
WT = W^T [N, K] (K contiguous), M <= BLOCK_M. Two families, one function (DOT picks, a constexpr):

    y[m, n] = sum_k x[m, k] * WT[n, k]          fp32 accumulation, one rounding to the element type at the end

A decode step multiplies a few rows by every weight of the model, so the product is the weight's bytes read once;
its speed is the bytes kept in flight. A program owns BLOCK_N whole rows of WT and streams them in
[BLOCK_N, BLOCK_K] tiles, every load a run of BLOCK_K contiguous elements, no partial sums shared between programs.

DOT = 0, the register GEMV (one row): acc += W_tile * x_tile, broadcast over the BLOCK_N rows and reduced over K
once after the loop. The next tile is loaded before the current one is used (one tile of register prefetch):
Triton's pipeliner stages only the operands of tl.dot. Past the last tile the prefetch wraps to the first (EVEN_K:
a valid address, its value unused). Wins where K is long and N short (Llama's o and down, GPT-2's mlp.c_proj).

DOT = 1, "skinny": acc[n, m] += WT_tile @ X_tile^T through tl.dot, the weight the MMA's A operand and the rows,
padded to BLOCK_M = 16, its B operand. Triton's pipeliner then stages the weight tiles in shared memory num_stages
deep (cp.async), the bytes in flight a wide product needs; the MMA's wasted rows cost nothing, the product is
memory-bound. Wins on wide weights and at 2-16 rows (session 24, bench/results/README.md).

Columns past N (the last program's) read row N - 1 again and are not stored; rows past M read zeros.
ort_triton/kernels/norm_linear.py runs the same DOT product with RMSNorm as its prologue.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_start, prefetch_rows


@triton.jit
def _dot(w, x, acc):
    """acc + w @ x^T; fp32 exactly (Triton's default for fp32 operands is TF32, 1e-3)."""
    if w.dtype == tl.float32:
        return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    else:
        return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _weight_tile(ptrs, k_ok, EVEN_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] tile of the weight, read once: evict_first keeps L2 for the activations. Unmasked when
    BLOCK_K divides K (the loads vectorise)."""
    if EVEN_K:
        return tl.load(ptrs, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _register_gemv(X, w_rows, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """sum_k x[k] * WT[n, k] for the program's BLOCK_N rows of WT (w_rows: their pointers), in fp32."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if EVEN_K:
        w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
        for k in range(0, K, BLOCK_K):
            k_next = (k + BLOCK_K) % K  # the last prefetch wraps to tile 0: valid, unused
            w_next = tl.load(w_rows + (k_next + ks)[None, :], eviction_policy="evict_first")
            x = tl.load(X + k + ks).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            w = w_next
    else:
        ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=ok[None, :], other=0.0, eviction_policy="evict_first")
        for k in range(0, K, BLOCK_K):
            nk = k + BLOCK_K + ks
            w_next = tl.load(w_rows + nk[None, :], mask=(nk < K)[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(X + k + ks, mask=k + ks < K, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            w = w_next
    return tl.sum(acc, axis=1)


@triton.jit
def gemv_fwd(X, WT, Y, M, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
             DOT: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr = 0):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = WT + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K  # clamped: always a valid row of WT
    prefetch_rows(w_rows, K, 2 * BLOCK_K, PDL)  # the first two tiles, while the kernel before runs (PDL)
    pdl_start(PDL)
    if DOT:
        rows = tl.arange(0, BLOCK_M)
        m_ok = rows < M
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k in range(0, K, BLOCK_K):  # pipelined num_stages deep (the spec's): the loads feed tl.dot
            k_ok = k + ks < K
            x = tl.load(X + rows[:, None] * K + (k + ks)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(_weight_tile(w_rows + (k + ks)[None, :], k_ok, EVEN_K), x, acc)
        out = rows[None, :].to(tl.int64) * N + cols[:, None]
        tl.store(Y + out, acc.to(Y.dtype.element_ty), mask=(cols < N)[:, None] & m_ok[None, :])
    else:  # one row
        y = _register_gemv(X, w_rows, K, BLOCK_N, BLOCK_K, EVEN_K)
        tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=cols < N)


def gemv(x, wt, y=None, *, block_n: int = 2, block_k: int = 1024, num_warps: int = 4, num_stages: int = 1,
         dot: bool = False):
    """Y[M, N] = X[M, K] @ wt[N, K]^T through the Triton JIT (tests and sweeps; the library runs the AOT build):
    M = 1 for the register GEMV, 1-16 for dot (the skinny kernel)."""
    import torch

    n, k = wt.shape
    rows = x.numel() // k if k else 0
    if x.shape[-1] != k or rows > (16 if dot else 1):
        most = "up to 16 rows" if dot else "one row"
        raise ValueError(f"x {list(x.shape)}: the weight's rows have {k} elements; {most}")
    y = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype) if y is None else y
    gemv_fwd[(triton.cdiv(n, block_n),)](x, wt, y, rows, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
                                          EVEN_K=k % block_k == 0, DOT=int(dot), BLOCK_M=16, num_warps=num_warps,
                                          num_stages=num_stages)
    return y
