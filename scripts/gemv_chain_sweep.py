"""Decode-shaped products (M = 1..16 rows) over a chain of distinct weights, on the GPU: cuBLAS as ORT's MatMul runs
it, Linear's GEMV (ort_triton/kernels/gemv.py), and a candidate that puts the weight through tl.dot (below).

Why a chain: one weight replayed stays in the 50 MB L2 where it fits, and cuBLAS then "reads" Llama's 33.5 MB gate
above HBM speed (session 23, scripts/gemv_sweep.py). In a model every weight of a decode step comes from HBM once,
so here each measurement runs L distinct weights back to back (L x the weight >= 256 MB, five times the L2) in one
CUDA graph and reports the time a product.

The candidate, `skinny_fwd`: Y^T[N, M] = WT[N, K] @ X^T[K, M] with M padded to 16, the weight the MMA's A operand
(BLOCK_N of its rows, K-major, as WT is stored) and the few rows of X its B operand. Through tl.dot Triton's
pipeliner stages the weight tiles in shared memory (cp.async, STAGES deep): the bytes in flight a GEMV needs
without the register prefetch of gemv_fwd, and the same kernel serves 1 to 16 rows (decode at batch 16).

    python scripts/gemv_chain_sweep.py [--json OUT.jsonl] [--rows 1,16] [--rep 20]

Rows: kind=copy (the device-to-device copy ceiling of this GPU, GB/s), kind=cublas (x @ W, W [K, N]: ORT's NN),
kind=gemv and kind=skinny (each config, checked against fp32 on the chain's first weight, then timed), kind=best
(the fastest of each family per shape and M, with its speedup over cuBLAS). Bytes: the weight (x and y are noise).
"""

import argparse
import functools
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ort_triton.kernels.gemv import gemv  # noqa: E402

CHAIN_BYTES = 256 << 20
SHAPES = (("llama-1b", "qkv", 2048, 3072), ("llama-1b", "o", 2048, 2048), ("llama-1b", "gate|up", 2048, 8192),
          ("llama-1b", "gate+up", 2048, 16384), ("llama-1b", "down", 8192, 2048), ("llama-1b", "lm_head", 2048, 32000),
          ("gpt2", "c_attn", 768, 2304), ("gpt2", "c_proj", 768, 768), ("gpt2", "c_fc", 768, 3072),
          ("gpt2", "mlp.c_proj", 3072, 768))
GEMV_CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=w)
                for bn, bk, w in itertools.product((2, 4), (1024, 2048), (4, 8))]
SKINNY_CONFIGS = [dict(block_n=bn, block_k=bk, stages=s, num_warps=4)
                  for bn, bk, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (3, 4, 6))]


@triton.jit
def skinny_fwd(X, WT, Y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               STAGES: tl.constexpr):
    # acc[n, m] = sum_k WT[n, k] * X[m, k]: the weight is the MMA's A operand, so BLOCK_N >= 64 can use wgmma
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = WT + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K  # clamped rows: valid, not stored
    ms = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):  # K % BLOCK_K == 0 (the sweep's shapes)
        w = tl.load(w_rows + (k + ks)[None, :], eviction_policy="evict_first")
        x = tl.load(X + ms[:, None] * K + (k + ks)[None, :], mask=ms[:, None] < M, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    y = Y + ms[None, :] * N + cols[:, None]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=(cols[:, None] < N) & (ms[None, :] < M))


@triton.jit
def _tile_sum_sq(X, R, S, offs, m_ok, write, T):
    """PRO 0 and 1's step: s = T(x + r) for a [BLOCK_M, BLOCK_K] tile, stored where `write`; the rows' sum of s^2."""
    s = (tl.load(X + offs, mask=m_ok, other=0.0).to(tl.float32) +
         tl.load(R + offs, mask=m_ok, other=0.0).to(tl.float32)).to(T)
    tl.store(S + offs, s, mask=m_ok & write)
    sf = s.to(tl.float32)
    return tl.sum(sf * sf, axis=1)


@triton.jit
def skinny_fused_fwd(X, R, G, WT, WT2, Y, S, M, N, K, eps, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PRO: tl.constexpr):
    # AddRMSNorm in the prologue: s = T(x + r), rstd per row from a first pass over K (program 0 writes s),
    # then the product of n = T(s * rstd * g) with WT (and WT2: SwiGLU, y = silu(T(n WT^T)) * T(n WT2^T)).
    # PRO, how rstd is found: 0 a plain loop of [BLOCK_M, BLOCK_K] tiles; 1 the same loop pipelined (tl.range
    # num_stages); 2 row by row in 1-D chunks of 2048; 3 no first pass: n' = T(s * g) in the loop, the sum of squares
    # beside it, rstd applied to the fp32 products (another rounding point than the graph's).
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K
    ms = tl.arange(0, BLOCK_M)
    m_ok = (ms < M)[:, None]
    ks = tl.arange(0, BLOCK_K)
    T = Y.dtype.element_ty
    ss = tl.zeros([BLOCK_M], tl.float32)
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if PRO == 0:
        for k in range(0, K, BLOCK_K):
            ss += _tile_sum_sq(X, R, S, ms[:, None] * K + (k + ks)[None, :], m_ok, pid == 0, T)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, tl.full([], K, tl.float32)) + eps))
    elif PRO == 1:
        for k in tl.range(0, K, BLOCK_K, num_stages=3):
            ss += _tile_sum_sq(X, R, S, ms[:, None] * K + (k + ks)[None, :], m_ok, pid == 0, T)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, tl.full([], K, tl.float32)) + eps))
    elif PRO == 2:
        nk = tl.arange(0, 2048)
        for m in range(M):
            acc_m = tl.zeros([2048], tl.float32)
            for k in range(0, K, 2048):
                ok = k + nk < K
                s = (tl.load(X + m * K + k + nk, mask=ok, other=0.0).to(tl.float32) +
                     tl.load(R + m * K + k + nk, mask=ok, other=0.0).to(tl.float32)).to(T)
                tl.store(S + m * K + k + nk, s, mask=ok & (pid == 0))
                sf = s.to(tl.float32)
                acc_m += sf * sf
            r_m = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(acc_m, axis=0), tl.full([], K, tl.float32)) + eps))
            rstd = tl.where(ms == m, r_m, rstd)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs = ms[:, None] * K + (k + ks)[None, :]
        s = (tl.load(X + offs, mask=m_ok, other=0.0).to(tl.float32) +
             tl.load(R + offs, mask=m_ok, other=0.0).to(tl.float32)).to(T)
        g = tl.load(G + k + ks).to(tl.float32)
        if PRO == 3:
            tl.store(S + offs, s, mask=m_ok & (pid == 0))
            sf = s.to(tl.float32)
            ss += tl.sum(sf * sf, axis=1)
            x = (sf * g[None, :]).to(T)
        else:
            x = (s.to(tl.float32) * rstd[:, None] * g[None, :]).to(T)
        w = tl.load(WT + safe + (k + ks)[None, :], eviction_policy="evict_first")
        acc = tl.dot(w, tl.trans(x), acc)
        if SWIGLU:
            w2 = tl.load(WT2 + safe + (k + ks)[None, :], eviction_policy="evict_first")
            acc2 = tl.dot(w2, tl.trans(x), acc2)
    if PRO == 3:
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, tl.full([], K, tl.float32)) + eps))
        acc = acc * rstd[None, :]
        acc2 = acc2 * rstd[None, :]
    if SWIGLU:
        gv = acc.to(T).to(tl.float32)
        acc = gv / (1.0 + tl.exp(-gv)) * acc2.to(T).to(tl.float32)
    y = Y + ms[None, :] * N + cols[:, None]
    tl.store(y, acc.to(T), mask=(cols[:, None] < N) & (ms[None, :] < M))


def skinny_fused(x, r, g, wt, wt2, y, s, *, block_n, block_k, stages, num_warps, pro=0):
    m, k = x.shape
    n = wt.shape[0]
    skinny_fused_fwd[(triton.cdiv(n, block_n),)](x, r, g, wt, wt if wt2 is None else wt2, y, s, m, n, k, 1e-5,
                                                 SWIGLU=wt2 is not None, BLOCK_M=16, BLOCK_N=block_n,
                                                 BLOCK_K=block_k, STAGES=stages, PRO=pro, num_warps=num_warps)
    return y


def skinny(x, wt, y, *, block_n, block_k, stages, num_warps):
    m, k = x.shape
    n = wt.shape[0]
    skinny_fwd[(triton.cdiv(n, block_n),)](x, wt, y, m, n, k, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                                           STAGES=stages, num_warps=num_warps)
    return y


def timed(fn, rep):
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3  # us


def chain_us(run, calls, rep):
    """us a call: `run(*args)` for every args tuple in `calls`, one after the other, in one CUDA graph."""
    def all_calls():
        for args in calls:
            run(*args)
    return timed(all_calls, rep) / len(calls)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write one JSON row per measurement here")
    ap.add_argument("--rep", type=int, default=20, help="ms of replays per measurement")
    ap.add_argument("--rows", default="1,16", help="M values (at most 16)")
    ap.add_argument("--shapes", help="only these ops (comma-separated names from SHAPES)")
    ap.add_argument("--no-fused", action="store_true", help="skip the AddRMSNorm (+ SwiGLU) fused candidates")
    args = ap.parse_args()
    out = open(args.json, "w") if args.json else None

    def emit(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")

    torch.manual_seed(0)
    dt = torch.float16
    big = torch.empty(1 << 29, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(big)
    copy_us = timed(functools.partial(dst.copy_, big), args.rep)
    copy_gbs = 2 * big.numel() / copy_us / 1e3
    emit(dict(kind="copy", gpu=torch.cuda.get_device_name(), bytes=2 * big.numel(), us=round(copy_us, 1),
              gbs=round(copy_gbs, 1)))
    big = dst = None
    only = set(args.shapes.split(",")) if args.shapes else None
    for model, name, k, n in SHAPES:
        if only and name not in only:
            continue
        wbytes = 2 * k * n
        chain = max(2, -(-CHAIN_BYTES // wbytes))
        ws = [torch.randn(k, n, device="cuda", dtype=dt) / k ** 0.5 for _ in range(chain)]  # ORT's layout
        wts = [w.t().contiguous() for w in ws]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = x.float() @ ws[0].float()
            base = dict(model=model, op=name, K=k, N=n, M=m, chain=chain)

            lib = chain_us(torch.matmul, [(x, w) for w in ws], args.rep)
            emit(dict(base, kind="cublas", us=round(lib, 2), pct_copy=round(100 * wbytes / lib / 1e3 / copy_gbs, 1)))
            families = [("skinny", SKINNY_CONFIGS, skinny)]
            if m == 1:
                families.insert(0, ("gemv", GEMV_CONFIGS, lambda x, wt, y, **c: gemv(x, wt, y.view(-1), **c)))
            for family, configs, run in families:
                best = None
                for cfg in configs:
                    if family == "gemv" and k % cfg["block_k"]:
                        continue
                    if family == "skinny" and (k % cfg["block_k"] or cfg["block_n"] > max(16, n)):
                        continue
                    ys = [torch.full((m, n), float("nan"), device="cuda", dtype=dt) for _ in range(chain)]
                    try:
                        run(x, wts[0], ys[0], **cfg)
                    except Exception as e:  # out of shared memory, a compile failure: say so, go on
                        emit(dict(base, kind=family, **cfg, error=f"{type(e).__name__}: {str(e)[:120]}"))
                        continue
                    err = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
                    if not err < 1e-2:
                        emit(dict(base, kind=family, **cfg, error=f"max rel err {err}"))
                        continue
                    us = chain_us(functools.partial(run, **cfg), [(x, wt, y) for wt, y in zip(wts, ys)], args.rep)
                    row = dict(base, kind=family, **cfg, us=round(us, 2), vs_cublas=round(lib / us, 3),
                               pct_copy=round(100 * wbytes / us / 1e3 / copy_gbs, 1))
                    emit(row)
                    if best is None or us < best["us"]:
                        best = row
                if best:
                    emit(dict(best, kind="best", family=family, cublas_us=round(lib, 2)))
        ws = wts = None
        torch.cuda.empty_cache()
    if not args.no_fused:
        fused(args, emit, copy_gbs)


FUSED_SHAPES = (("llama-1b", "norm+qkv", 2048, 3072, False), ("llama-1b", "norm+gate,up+swiglu", 2048, 8192, True))
FUSED_CONFIGS = [dict(block_n=bn, block_k=bk, stages=s, num_warps=4, pro=p)
                 for p, bn, bk, s in itertools.product((0, 1, 2, 3), (32, 64), (128, 256), (3, 4))]


def library(a, b, gamma, layer):
    """What the library runs today for AddRMSNorm + a projection (+ SwiGLU): ours, cuBLAS, ours."""
    from ort_triton.kernels.rms_norm import rms_norm
    from ort_triton.kernels.swiglu import silu_mul

    nrm, _ = rms_norm(a, gamma, skip=b, epsilon=1e-5, store_sum=True)
    if len(layer) == 1:
        return torch.matmul(nrm, layer[0])
    return silu_mul(torch.matmul(nrm, layer[0]), torch.matmul(nrm, layer[1]))


def fused(args, emit, copy_gbs):
    """AddRMSNorm + the projection (+ SwiGLU) as one skinny launch, against what the library runs today: our
    AddRMSNorm kernel, cuBLAS (ORT's NN layout) per weight, and our SiluMul for SwiGLU."""
    dt = torch.float16
    for model, name, k, n, swiglu in FUSED_SHAPES:
        nw = 2 if swiglu else 1
        wbytes = 2 * k * n * nw
        chain = max(2, -(-CHAIN_BYTES // wbytes))
        ws = [[torch.randn(k, n, device="cuda", dtype=dt) / k ** 0.5 for _ in range(nw)] for _ in range(chain)]
        wts = [[w.t().contiguous() for w in layer] for layer in ws]
        gamma = (1 + 0.1 * torch.randn(k, device="cuda")).to(dt)
        for m in map(int, args.rows.split(",")):
            a = torch.randn(m, k, device="cuda", dtype=dt)
            b = torch.randn(m, k, device="cuda", dtype=dt)
            base = dict(model=model, op=name, K=k, N=n, M=m, chain=chain)

            ref = library(a, b, gamma, ws[0]).float()
            lib = chain_us(library, [(a, b, gamma, layer) for layer in ws], args.rep)
            emit(dict(base, kind="fused_library", us=round(lib, 2),
                      pct_copy=round(100 * wbytes / lib / 1e3 / copy_gbs, 1)))
            best = {}  # per prologue variant
            for cfg in FUSED_CONFIGS:
                ys = [torch.full((m, n), float("nan"), device="cuda", dtype=dt) for _ in range(chain)]
                sums = torch.full((m, k), float("nan"), device="cuda", dtype=dt)
                calls = [(a, b, gamma, lt[0], lt[1] if swiglu else None, y, sums) for lt, y in zip(wts, ys)]
                try:
                    skinny_fused(*calls[0], **cfg)
                except Exception as e:
                    emit(dict(base, kind="fused", **cfg, error=f"{type(e).__name__}: {str(e)[:120]}"))
                    continue
                err = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
                s_err = (sums.float() - (a.float() + b.float())).abs().max().item()
                if not (err < 1e-2 and s_err < 1e-2):
                    emit(dict(base, kind="fused", **cfg, error=f"max rel err {err}, sum err {s_err}"))
                    continue
                us = chain_us(functools.partial(skinny_fused, **cfg), calls, args.rep)
                row = dict(base, kind="fused", **cfg, us=round(us, 2), vs_library=round(lib / us, 3),
                           pct_copy=round(100 * wbytes / us / 1e3 / copy_gbs, 1))
                emit(row)
                if cfg["pro"] not in best or us < best[cfg["pro"]]["us"]:
                    best[cfg["pro"]] = row
            for row in best.values():
                emit(dict(row, kind="best", family=f"fused_pro{row['pro']}", library_us=round(lib, 2)))
        ws = wts = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
