"""A Triton linear layer with its epilogue fused: Y = act(X @ W + bias), X [M, K], W [K, N] (ONNX MatMul's
weight layout, row-major), bias [N], act in {none, GELU erf, GELU tanh}; fp32 accumulation.

This is the candidate that issue 3 asks to measure against cuBLAS (`python -m ort_triton.bench.linear`):
the library calls cuBLAS through ORT's own MatMul and fuses only the epilogue (BiasGelu, AddLayerNorm's
bias), and this kernel is what "a GEMM of ours" would be. The bench times it against cuBLAS plus our
epilogue at BERT and Llama shapes, so the choice per shape is a measurement, not a guess.

Program layout: one program per BLOCK_M x BLOCK_N tile of Y, in groups of GROUP_M tile rows so that the
programs running together share W's column blocks and X's row blocks in L2 (the ordering of Triton's
matmul tutorial). Rows past M and columns past N are clamped to valid addresses on load (row % M) and
masked on store, so the K loop loads unmasked unless K is not a multiple of BLOCK_K (EVEN_K).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bias_gelu import gelu

ACTIVATIONS = {"none": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def linear_fwd(X, W, B, Y, M, N, K, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    rows_here = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % rows_here
    pid_n = (pid % in_group) // rows_here

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_m % M).to(tl.int64)  # clamped: a valid row, never stored
    cols = offs_n % N
    x_ptrs = X + rows[:, None] * K + offs_k[None, :]
    w_ptrs = W + offs_k.to(tl.int64)[:, None] * N + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * N

    if HAS_BIAS:
        acc += tl.load(B + cols).to(tl.float32)[None, :]
    if ACT != 0:
        TANH: tl.constexpr = ACT == 2
        acc = gelu(acc, TANH)
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the bench's candidates, from large tiles for
# compute-bound shapes to 16-row tiles for decode-sized M
CONFIGS = (
    (128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3), (128, 128, 32, 8, 4, 4), (128, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 4), (64, 64, 64, 8, 4, 4), (64, 32, 64, 8, 4, 4), (32, 64, 64, 8, 4, 4),
    (32, 32, 128, 8, 4, 4), (16, 64, 128, 1, 4, 4), (16, 32, 256, 1, 4, 3), (16, 128, 64, 1, 4, 4),
)


def linear(x, w, bias=None, activation: str = "none", *, out=None, config=CONFIGS[2]):
    """Y = act(x @ w + bias) for torch tensors x [M, K], w [K, N], bias [N] (one dtype)."""
    import torch

    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"linear: x must be [M, K] and w [K, N], got {list(x.shape)} and {list(w.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16) or w.dtype != x.dtype:
        raise TypeError(f"linear: x and w must both be float16 or bfloat16, got {x.dtype} and {w.dtype}")
    m, k = x.shape
    n = w.shape[1]
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"linear: bias must be {x.dtype} of shape [{n}], got {bias.dtype} {list(bias.shape)}")
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk, gm, warps, stages = config
    if m and n:
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        linear_fwd[grid](x.contiguous(), w.contiguous(), bias if bias is not None else y, y, m, n, k,
                         ACT=ACTIVATIONS[activation], HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps, num_stages=stages)
    return y
