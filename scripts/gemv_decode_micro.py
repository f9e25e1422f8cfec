"""Decode-step GEMMs (M = batch rows of one token each) as a Triton split-K GEMV against cuBLAS (torch.matmul,
what ORT's MatMul runs) at Llama-1B's weight shapes, fp16 on the GPU. Issue 5: cuBLAS reads the decode step's
weights at ~57% of the 4.08 TB/s copy ceiling (session 6's profile); this measures what a GEMV written for
the shape reaches, before any of it goes into the library.

The kernel: y[M, N] = x[M, K] @ W[K, N], W row-major as ONNX's MatMul stores it. Program (n, s) reads the
[K / SPLIT, BLOCK_N] strip s of W's columns n * BLOCK_N.. once, in [BLOCK_K, BLOCK_N] tiles (BLOCK_N * 2
bytes contiguous per row), and writes its fp32 partial to P[s]; a second launch sums P over s in a fixed
order and casts (deterministic: no atomics). SPLIT = 1 writes y directly, one launch.

    python scripts/gemv_decode_micro.py [--rows 1,16] [--json OUT.jsonl]

Each runner is timed as CUDA-graph replays (triton.testing.do_bench_cudagraph, median), after a check against
torch in fp32 (rel. err < 1e-2). Bytes: W + x + y; % of 4.08 TB/s.
"""

import argparse
import functools
import itertools
import json

import torch
import triton
import triton.language as tl
import triton.testing

CEILING_GBS = 4080.0
# (name, K, N) of Llama-1B (hidden 2048, 32 x 64 query heads, 8 KV heads, intermediate 8192, vocab 32000):
# the layer's projections, the packed forms a rewrite could make, and the LM head.
SHAPES = (("q_o", 2048, 2048), ("k_v", 2048, 512), ("qkv_packed", 2048, 3072), ("gate_up", 2048, 8192),
          ("gate_up_packed", 2048, 16384), ("down", 8192, 2048), ("lm_head", 2048, 32000))


@triton.jit
def gemv_partial(X, W, P, M, N, K, k_chunk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT: tl.constexpr):
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_s * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        w = tl.load(W + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :],
                    mask=k_ok[:, None] & (offs_n < N)[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(X + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m < M)[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M >= 16:  # tensor cores
            acc += tl.dot(x, w)
        else:  # one row: a broadcast multiply and a sum over the tile's K
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if DIRECT:
        tl.store(P + offs_m[:, None] * N + offs_n[None, :], acc.to(P.dtype.element_ty), mask=mask)
    else:
        tl.store(P + (pid_s * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def gemv_reduce(P, Y, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT):
        acc += tl.load(P + s * MN + offs, mask=ok, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def gemv(x, w, split, block_n, block_k, warps, y=None, ws=None):
    m, k = x.shape
    n = w.shape[1]
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    y = torch.empty(m, n, device=x.device, dtype=x.dtype) if y is None else y
    k_chunk = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_chunk)
    grid = (triton.cdiv(n, block_n), split)
    if split == 1:
        gemv_partial[grid](x, w, y, m, n, k, k_chunk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           DIRECT=True, num_warps=warps)
        return y
    ws = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if ws is None else ws
    gemv_partial[grid](x, w, ws, m, n, k, k_chunk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                       DIRECT=False, num_warps=warps)
    gemv_reduce[(triton.cdiv(m * n, 1024),)](ws, y, m * n, SPLIT=split, BLOCK=1024, num_warps=4)
    return y


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16")
    p.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    p.add_argument("--splits", default="1,2,4,8,16")
    p.add_argument("--block-n", default="64,128,256")
    p.add_argument("--block-k", default="64,128")
    p.add_argument("--warps", default="4")
    p.add_argument("--rep", type=int, default=20, help="ms of replays per timing")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    out = open(args.json, "w") if args.json else None
    for name, k, n in (s for s in SHAPES if s[0] in args.shapes.split(",")):
        w = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
        for m in ints(args.rows):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            want = x.float() @ w.float()
            nbytes = (k * n + m * k + m * n) * 2
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            cublas_ms = triton.testing.do_bench_cudagraph(functools.partial(torch.matmul, x, w, out=y),
                                                          rep=args.rep, return_mode="median")
            best = None
            for split, bn, bk, warps in itertools.product(ints(args.splits), ints(args.block_n), ints(args.block_k),
                                                          ints(args.warps)):
                if m == 1 and bn * bk > 16384:  # the broadcast tile in registers
                    continue
                ws = torch.empty(split, m, n, device="cuda", dtype=torch.float32)
                got = gemv(x, w, split, bn, bk, warps, y=y, ws=ws)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                if not err < 1e-2:
                    raise AssertionError(f"{name} M={m} split={split} {bn}x{bk}: rel err {err:.2e}")
                ms = triton.testing.do_bench_cudagraph(functools.partial(gemv, x, w, split, bn, bk, warps, y=y, ws=ws),
                                                       rep=args.rep, return_mode="median")
                if best is None or ms < best[0]:
                    best = (ms, dict(split=split, block_n=bn, block_k=bk, warps=warps))
            row = dict(shape=name, M=m, K=k, N=n, cublas_us=cublas_ms * 1e3, triton_us=best[0] * 1e3, config=best[1],
                       cublas_pct=nbytes / cublas_ms / 1e6 / CEILING_GBS * 100,
                       triton_pct=nbytes / best[0] / 1e6 / CEILING_GBS * 100, speedup=cublas_ms / best[0])
            print(f"{name:15} M={m:2} K={k:5} N={n:5}  cuBLAS {row['cublas_us']:7.2f} us ({row['cublas_pct']:4.1f}%)  "
                  f"Triton {row['triton_us']:7.2f} us ({row['triton_pct']:4.1f}%)  {row['speedup']:.2f}x  {best[1]}",
                  flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
