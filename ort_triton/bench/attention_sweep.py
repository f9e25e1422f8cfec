"""Sweep the attention kernel's tiles and launch options (BLOCK_M x BLOCK_N, warps, stages) per head dim on
the GPU: the evidence behind ort_triton.ops.attention._CONFIGS.

    python -m ort_triton.bench.attention_sweep --json OUT.json [--shape 8x2048] [--head-dims 64,128]

Each candidate runs through Triton's JIT on the same fp16 inputs (a padding mask, 12 heads of D at
--shape), timed in a CUDA graph of its launches (do_bench_cudagraph, median); candidates that fail to
compile or run out of shared memory are reported and skipped.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json


def main(argv=None) -> None:
    import torch
    import triton

    from ..kernels.attention import attention
    from ..ops.attention import HEAD_DIMS, block_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8x2048", help="BATCHxSEQ")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    b, s = map(int, args.shape.split("x"))
    out = []
    for d in map(int, args.head_dims.split(",")):
        n = args.heads
        q, k, v = (torch.randn(b, s, n * d, device="cuda", dtype=torch.float16) for _ in range(3))
        keep = torch.arange(s, device="cuda")[None, :] < torch.randint(s // 2, s + 1, (b, 1), device="cuda")
        kb = torch.where(keep, 0.0, torch.finfo(torch.float16).min).to(torch.float16)
        bias = torch.randn(n * d, device="cuda", dtype=torch.float16)
        flops = 4 * b * n * s * s * d
        current = block_config(d, "float16")
        results = {}
        for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            try:
                fn = functools.partial(attention, q, k, v, kb, n, d**-0.5, k_bias=bias, v_bias=bias,
                                       config=cfg)
                fn()  # compile outside the graph capture
                ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
            except Exception as e:  # noqa: BLE001  (out of shared memory, compile errors: skip and say so)
                print(f"D={d} {cfg}: skipped ({type(e).__name__}: {str(e)[:80]})")
                continue
            results[f"{bm}x{bn}/w{warps}/s{stages}"] = ms
        best = min(results, key=results.get)
        cur = f"{current['BLOCK_M']}x{current['BLOCK_N']}/w{current['num_warps']}/s{current['num_stages']}"
        print(f"D={d:3} best {best:16} {results[best]:.3f} ms {flops / results[best] / 1e9:6.1f} TFLOP/s | "
              f"current {cur} {results.get(cur, float('nan')):.3f} ms", flush=True)
        out.append(dict(head_dim=d, batch=b, seq=s, heads=n, best=best, current=cur, all_ms=results))
    with open(args.json, "w") as fh:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": out}, fh, indent=1)


if __name__ == "__main__":
    main()
