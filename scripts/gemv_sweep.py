"""Linear's kernels on the GPU, before their specs are fixed: the one-row GEMV (ort_triton/kernels/gemv.py) over
its configs, and cuBLAS on the transposed weight (what Linear runs for more than one row) against cuBLAS on
ONNX's layout (what ORT's MatMul runs), at Llama-1B's and GPT-2 small's projection shapes.

    python scripts/gemv_sweep.py [--json OUT.jsonl] [--rep 50]

Rows: kind=gemv (M = 1: each config, checked against fp32 first), kind=cublas (M rows: x @ W with W [K, N]
row-major, "NN", against x @ WT^T with WT [N, K], "TN"). Timing: triton.testing.do_bench_cudagraph, median
of CUDA-graph replays. Bytes: the weight, x and y; % of 4.08 TB/s (the H200's copy ceiling).

Caveat (session 23): one weight replayed stays in L2 where it fits (the H100's 50 MB holds Llama's 33.5 MB gate),
which cuBLAS profits from and the GEMV, loading with evict_first, does not: cuBLAS read the gate at "3.74 TB/s",
above the H100's HBM. Decide on the model's own step (ort_triton.bench.ab, scripts/gpu_session23.sh), where every
weight comes from HBM, or on a chain of distinct weights (scripts/decode_linear_micro.py).
"""

import argparse
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ort_triton.kernels.gemv import gemv  # noqa: E402

CEILING_GBS = 4080.0
# (model, name, K, N): the projections as the library's rewrites leave them (Q/K/V packed; gate and up apart)
SHAPES = (("llama-1b", "qkv", 2048, 3072), ("llama-1b", "o", 2048, 2048), ("llama-1b", "gate|up", 2048, 8192),
          ("llama-1b", "down", 8192, 2048), ("llama-1b", "lm_head", 2048, 32000),
          ("gpt2", "c_attn", 768, 2304), ("gpt2", "c_proj", 768, 768), ("gpt2", "c_fc", 768, 3072),
          ("gpt2", "mlp.c_proj", 3072, 768), ("gpt2", "lm_head", 768, 50264))
CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=w) for bn, bk, w in
           itertools.product((1, 2, 4), (512, 1024, 2048), (4, 8))]


def timed(fn, rep):
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3  # us


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write one JSON row per measurement here")
    ap.add_argument("--rep", type=int, default=50, help="ms of replays per measurement")
    ap.add_argument("--rows", default="2,4,16,512", help="M for the cuBLAS comparison")
    args = ap.parse_args()
    out = open(args.json, "w") if args.json else None

    def emit(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")

    torch.manual_seed(0)
    dt = torch.float16
    for model, name, k, n in SHAPES:
        w = torch.randn(k, n, device="cuda", dtype=dt) / k ** 0.5
        wt = w.t().contiguous()
        x = torch.randn(1, k, device="cuda", dtype=dt)
        ref = (x.float() @ w.float()).view(-1)
        nbytes = 2 * (k * n + k + n)
        lib = timed(lambda x=x, w=w: torch.matmul(x, w), args.rep)
        best = None
        for cfg in CONFIGS:
            y = torch.full((n,), float("nan"), device="cuda", dtype=dt)
            gemv(x, wt, y, **cfg)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                emit(dict(kind="gemv", model=model, op=name, K=k, N=n, **cfg, error=err, ok=False))
                continue
            us = timed(lambda x=x, wt=wt, cfg=cfg, y=y: gemv(x, wt, y, **cfg), args.rep)
            row = dict(kind="gemv", model=model, op=name, K=k, N=n, **cfg, us=round(us, 2), cublas_nn_us=round(lib, 2),
                       speedup=round(lib / us, 3), pct_ceiling=round(100 * nbytes / us / 1e3 / CEILING_GBS, 1))
            emit(row)
            if best is None or us < best["us"]:
                best = row
        emit(dict(best, kind="gemv_best"))
        for m in map(int, args.rows.split(",")):
            xm = torch.randn(m, k, device="cuda", dtype=dt)
            nn = timed(lambda xm=xm, w=w: torch.matmul(xm, w), args.rep)
            tn = timed(lambda xm=xm, wt=wt: torch.matmul(xm, wt.t()), args.rep)
            emit(dict(kind="cublas", model=model, op=name, K=k, N=n, M=m, nn_us=round(nn, 2), tn_us=round(tn, 2),
                      tn_vs_nn=round(nn / tn, 3)))


if __name__ == "__main__":
    main()
