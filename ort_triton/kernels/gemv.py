"""Linear's one-row kernel: y[N] = x[K] @ W[K, N] with the weight held transposed, WT = W^T [N, K].

    y[n] = sum_k x[k] * WT[n, k]          fp32 accumulation, one rounding to the element type at the end

A decode step at batch 1 multiplies one row by every weight of the model; cuBLAS reads those weights at
46-70% of the GPU's bandwidth (scripts/decode_linear_micro.py). With K contiguous (the rewrite stores the
constant weight transposed), a program owns BLOCK_N whole rows of WT and streams them in [BLOCK_N, BLOCK_K]
tiles, so every load is a run of BLOCK_K contiguous elements and no program needs another's partial sums.

The accumulator is the tile's shape: acc += W_tile * x_tile (broadcast over the BLOCK_N rows), reduced over K
once after the loop, so the loop body is loads and FMAs only. The next tile is loaded before the current one
is used (one tile of register prefetch): Triton's pipeliner stages only the operands of tl.dot, and a GEMV's
speed is the number of bytes in flight. With EVEN_K (K a multiple of BLOCK_K) the loads are unmasked and the
prefetch past the last tile wraps to the first (a valid address, its value unused).

Columns past N (the last program's) load row N - 1 again and are not stored.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_fwd(X, WT, Y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, N - 1).to(tl.int64)  # clamped: always a valid row of WT
    w_rows = WT + rows[:, None] * K
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
    y = tl.sum(acc, axis=1)
    tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=cols < N)


def gemv(x, wt, y=None, *, block_n: int = 2, block_k: int = 1024, num_warps: int = 4, num_stages: int = 1):
    """y[1, N] = x[1, K] @ wt[N, K]^T through the Triton JIT (tests and sweeps; the library runs the AOT build)."""
    import torch

    n, k = wt.shape
    if x.numel() != k:
        raise ValueError(f"x has {x.numel()} elements, the weight's rows {k}")
    y = torch.empty(n, device=x.device, dtype=x.dtype) if y is None else y
    gemv_fwd[(triton.cdiv(n, block_n),)](x, wt, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
                                          EVEN_K=k % block_k == 0, num_warps=num_warps, num_stages=num_stages)
    return y
