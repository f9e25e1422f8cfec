"""GEMM + epilogue candidates against cuBLAS on the GPU, BERT-base shapes, fp16 (Triton JIT, CUDA-graph
replays, median us). One JSON line per (layer, M): cuBLAS alone, cuBLAS + our epilogue kernel (what the
library runs), and the best config of each Triton candidate with its epilogue fused:

- tiled: kernels/linear.py as it is (one program per output tile);
- tma: one program per SM walking the tiles, the tile loop flattened into the K loop so that the next
  tile's loads are in flight while this one's epilogue runs (K = 768 is only 12 steps of 64, so a tile's
  prologue and epilogue are a large share of its time), X, W and Y moved by TMA descriptors made on the
  device; optionally warp-specialised, optionally with the epilogue in two column halves.
  (The first run also timed the same persistent loop with pointer loads: 0.45-0.72x of the library's
  cuBLAS + epilogue at every shape, bench/results/session8/gemm_candidates_first.jsonl.)

    python scripts/gemm_candidates.py [--layers ffn1,qkv] [--rows 1024,16384]
"""
import argparse
import json
import math

import torch
import triton
import triton.language as tl
import triton.testing

from ort_triton.kernels.bias_gelu import bias_gelu, gelu
from ort_triton.kernels.linear import CONFIGS, linear


@triton.jit
def _tile(t, num_m, num_n, GROUP_M: tl.constexpr):
    in_group = GROUP_M * num_n
    first_m = (t // in_group) * GROUP_M
    rows_here = min(num_m - first_m, GROUP_M)
    return first_m + (t % in_group) % rows_here, (t % in_group) // rows_here


@triton.jit
def tma_fwd(X, W, B, Y, M, N, K, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_SMS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            WARP_SPEC: tl.constexpr = False, SPLIT: tl.constexpr = False):
    start = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    xd = tl.make_tensor_descriptor(X, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    wd = tl.make_tensor_descriptor(W, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    YB: tl.constexpr = BLOCK_N // 2 if SPLIT else BLOCK_N
    yd = tl.make_tensor_descriptor(Y, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, YB])
    out_t = start - NUM_SMS
    for t in tl.range(start, num_m * num_n, NUM_SMS, flatten=True, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile(t, num_m, num_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for ks in range(k_steps):
            a = xd.load([pid_m * BLOCK_M, ks * BLOCK_K])
            b = wd.load([ks * BLOCK_K, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
        out_t += NUM_SMS
        om, on = _tile(out_t, num_m, num_n, GROUP_M)
        if HAS_BIAS:
            offs_n = on * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            acc = gelu(acc, ACT == 2)
        if SPLIT:  # the epilogue in two halves of columns: half the registers and staging buffer at a time
            a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            yd.store([om * BLOCK_M, on * BLOCK_N], a0.to(Y.dtype.element_ty))
            yd.store([om * BLOCK_M, on * BLOCK_N + YB], a1.to(Y.dtype.element_ty))
        else:
            yd.store([om * BLOCK_M, on * BLOCK_N], acc.to(Y.dtype.element_ty))


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, WARP_SPEC, SPLIT)
TMA = tuple((*c, ws, sp) for c in ((128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 5), (128, 128, 64, 8, 4, 4),
                                   (128, 256, 64, 8, 8, 4), (128, 128, 64, 8, 8, 4), (128, 64, 64, 8, 4, 4))
            for ws in (False, True) for sp in (False, True))
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
LAYERS = {"q": (768, 768, "bias"), "out": (768, 768, "none"), "ffn1": (768, 3072, "gelu"),
          "ffn2": (3072, 768, "none"), "qkv": (768, 2304, "bias")}


def _launch(kernel, x, w, b, y, act, cfg):
    bm, bn, bk, gm, warps, stages, *extra = cfg
    more = dict(zip(("WARP_SPEC", "SPLIT"), extra))
    m, k = x.shape
    n = w.shape[1]
    grid = (min(SMS, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
    kernel[grid](x, w, b if b is not None else y, y, m, n, k, ACT=act, HAS_BIAS=b is not None, NUM_SMS=SMS,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps, num_stages=stages, **more)


def _ms(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def _best(run, configs, ref, y):
    best = (math.inf, None)
    for cfg in configs:
        try:
            y.fill_(float("nan"))
            run(cfg)
            err = (y.float() - ref).abs().max().item()
            if not err < 5e-2:
                print(f"  {cfg}: wrong, max err {err}", flush=True)
                continue
            best = min(best, (_ms(lambda cfg=cfg: run(cfg)), cfg))
        except Exception as exc:  # out of shared memory, a compile error: skip the config, say which
            print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    return best


def one(layer: str, m: int) -> dict:
    k, n, epi = LAYERS[layer]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).half()
    w = (torch.randn(k, n, device="cuda", generator=g) / k**0.5).half()
    b = torch.randn(n, device="cuda", generator=g).half() if epi != "none" else None
    act = 1 if epi == "gelu" else 0
    s = x.float() @ w.float() + (b.float() if b is not None else 0)
    ref = torch.nn.functional.gelu(s) if act else s
    y = torch.empty(m, n, device="cuda", dtype=torch.half)
    row = {"layer": layer, "M": m, "K": k, "N": n, "epilogue": epi,
           "cublas": _ms(lambda: torch.matmul(x, w, out=y))}
    epilogue_runs = {"none": lambda: torch.matmul(x, w, out=y), "bias": lambda: torch.add(x @ w, b, out=y),
                     "gelu": lambda: bias_gelu(x @ w, b, out=y)}
    row["cublas_epilogue"] = row["cublas"] if epi == "none" else _ms(epilogue_runs[epi])
    act_name = "gelu" if act else "none"
    for name, run, configs in (
            ("tiled", lambda c: linear(x, w, b, act_name, out=y, config=c), CONFIGS),
            ("tma", lambda c: _launch(tma_fwd, x, w, b, y, act, c), TMA)):
        t, cfg = _best(run, configs, ref, y)
        row[name], row[name + "_config"] = t, cfg
        row[name + "_vs_library"] = row["cublas_epilogue"] / t
    row["tflops_cublas"] = 2 * m * n * k / row["cublas"] / 1e6
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="ffn1,qkv,out,ffn2")
    p.add_argument("--rows", default="128,1024,4096,16384")
    args = p.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for layer in args.layers.split(","):
        for m in map(int, args.rows.split(",")):
            r = one(layer, m)
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)


if __name__ == "__main__":
    main()
