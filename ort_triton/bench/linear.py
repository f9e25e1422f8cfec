"""Linear layers on the GPU: cuBLAS (what ORT's MatMul runs) plus our epilogue, against a Triton GEMM with
the epilogue fused (kernels/linear.py), at BERT-base and Llama-1B shapes, fp16; and Q/K/V packed into one
GEMM against three. This is the measurement behind "call cuBLAS through ORT's MatMul and fuse only the
epilogue" (issue 3), decided per shape.

    python -m ort_triton.bench.linear --json OUT.json

Each runner's launches are replayed in a CUDA graph (triton.testing.do_bench_cudagraph, median), so small
shapes time the kernels and not the Python launchers. The Triton column is the best of kernels/linear.py's
CONFIGS at that shape (the config is in the JSON); `triton_speedup` is cuBLAS + epilogue time over the Triton
kernel's (above 1: the Triton kernel is faster; session 6's files call it triton_over_cublas). The floor is
max(2MNK / 989 TFLOP/s, bytes / 4.08 TB/s) (H200 dense fp16 and HBM; bytes = X, W and Y once).
"""

from __future__ import annotations

import argparse
import json
import math

PEAK_FLOPS, PEAK_BYTES = 989e12, 4.08e12
# (model, layer, K, N, epilogue): the epilogue is what the library runs after ORT's MatMul today
LAYERS = (
    ("bert-base", "q (+ bias Add)", 768, 768, "bias"),
    ("bert-base", "attn out (bias in AddLayerNorm)", 768, 768, "none"),
    ("bert-base", "ffn1 (+ BiasGelu)", 768, 3072, "gelu"),
    ("bert-base", "ffn2 (bias in AddLayerNorm)", 3072, 768, "none"),
    ("llama-1b", "q/k/v packed", 2048, 3072, "none"),
    ("llama-1b", "o", 2048, 2048, "none"),
    ("llama-1b", "down", 8192, 2048, "none"),
)
ROWS = {"bert-base": (128, 1024, 4096, 16384), "llama-1b": (1, 16, 512, 4096)}


def _ms(fn) -> float:
    import triton

    fn()  # compile (Triton) and pick the algorithm (cuBLAS) outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _triton_best(x, w, b, act) -> tuple[float, tuple | None]:
    import triton

    from ..kernels.linear import CONFIGS, linear

    best = (math.inf, None)
    for cfg in CONFIGS:
        try:
            t = _ms(lambda cfg=cfg: linear(x, w, b, act, config=cfg))
        except (triton.runtime.errors.OutOfResources, RuntimeError) as exc:  # too much shared memory: skip it
            print(f"    config {cfg} skipped: {type(exc).__name__}", flush=True)
            continue
        best = min(best, (t, cfg))
    return best


def _one(model, layer, m, k, n, epilogue) -> dict:
    import torch

    from ..kernels.bias_gelu import bias_gelu

    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w = torch.randn(k, n, device="cuda", dtype=torch.float16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.float16)
    gemm = _ms(lambda: torch.matmul(x, w))
    with_epilogue = {"none": lambda: torch.matmul(x, w), "bias": lambda: torch.matmul(x, w) + b,
                     "gelu": lambda: bias_gelu(torch.matmul(x, w), b)}[epilogue]
    cublas = gemm if epilogue == "none" else _ms(with_epilogue)
    act = {"none": "none", "bias": "none", "gelu": "gelu"}[epilogue]
    triton_ms, cfg = _triton_best(x, w, b if epilogue != "none" else None, act)
    flops, nbytes = 2 * m * n * k, 2 * (m * k + k * n + m * n)
    floor = max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e3
    return dict(model=model, layer=layer, M=m, K=k, N=n, epilogue=epilogue, cublas_gemm_ms=gemm,
                cublas_with_epilogue_ms=cublas, triton_ms=triton_ms, triton_config=cfg, floor_ms=floor,
                triton_speedup=cublas / triton_ms, cublas_fraction_of_floor=floor / cublas,
                triton_fraction_of_floor=floor / triton_ms)


def _packed_qkv(m, k, hidden) -> dict:
    """BERT's three [k, hidden] projections as three cuBLAS GEMMs, against one on the [k, 3*hidden] weight."""
    import torch

    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    ws = [torch.randn(k, hidden, device="cuda", dtype=torch.float16) / k**0.5 for _ in range(3)]
    packed = torch.cat(ws, 1)
    three = _ms(lambda: [torch.matmul(x, w) for w in ws])
    one = _ms(lambda: torch.matmul(x, packed))
    return dict(M=m, K=k, N=hidden, three_gemms_ms=three, packed_gemm_ms=one, packed_speedup=three / one)


def main(argv=None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="bert-base,llama-1b")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    models = args.models.split(",")
    rows, packed = [], []
    print(f"{'model':9} {'layer':40} {'M':>6} {'K':>5} {'N':>5} {'cuBLAS':>8} {'+epi':>8} {'triton':>8} "
          f"{'cub/tri':>7} {'floor':>7} {'cfg'}")
    for model, layer, k, n, epilogue in LAYERS:
        if model not in models:
            continue
        for m in ROWS[model]:
            r = _one(model, layer, m, k, n, epilogue)
            rows.append(r)
            print(f"{model:9} {layer:40} {m:6} {k:5} {n:5} {r['cublas_gemm_ms'] * 1e3:7.1f}u "
                  f"{r['cublas_with_epilogue_ms'] * 1e3:7.1f}u {r['triton_ms'] * 1e3:7.1f}u "
                  f"{r['triton_speedup']:7.2f} {r['floor_ms'] * 1e3:6.1f}u {r['triton_config']}", flush=True)
    if "bert-base" in models:
        for m in ROWS["bert-base"]:
            r = _packed_qkv(m, 768, 768)
            packed.append(r)
            print(f"bert-base q/k/v M={m}: three GEMMs {r['three_gemms_ms'] * 1e3:.1f} us, packed "
                  f"{r['packed_gemm_ms'] * 1e3:.1f} us: {r['packed_speedup']:.2f}x", flush=True)
    with open(args.json, "w") as fh:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "packed_qkv": packed}, fh, indent=1)


if __name__ == "__main__":
    main()
