"""Decode attention speed on the GPU: one new token per sequence over a KV cache (grouped-query), our
CausalAttention kernel in one pass and split over the cache (the library's default for decode), against
PyTorch's scaled_dot_product_attention (enable_gqa), same inputs.

    python -m ort_triton.bench.decode_attention --json OUT.json [--shapes 1x1024,16x4096] [--heads 32 --kv-heads 8]

Bytes counted: the cache read once, K and V, 2 * B * Nkv * T * D elements (Q, Y and the split's workspace
are under 1% of it at these shapes), over the median time (each runner replayed in a CUDA graph,
triton.testing.do_bench_cudagraph: a decode kernel runs for less time than Python takes to launch it).
Ceiling: the 4.08 TB/s device-to-device copy of shared/notes/FACTS.md.
"""

from __future__ import annotations

import argparse
import json

CEILING_GBPS = 4080.0


def _one_shape(b: int, t: int, nq: int, nkv: int, d: int) -> dict:
    import torch
    import triton

    from ..kernels.causal_attention import causal_attention
    from ..ops.causal_attention import block_config, split_chunks, split_keys

    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *shape: torch.randn(shape, generator=gen, device="cuda", dtype=torch.float16)
    q, k, v = r(b, nq, 1, d), r(b, nkv, t, d), r(b, nkv, t, d)
    kb = torch.zeros(b, t, device="cuda", dtype=torch.float16)
    scale = d**-0.5
    y = torch.empty(b, 1, nq * d, device="cuda", dtype=torch.float16)

    def ms(fn):
        fn()  # compile outside the capture
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")

    one_pass = ms(lambda: causal_attention(q, k, v, kb, scale, out=y, config=dict(SPLIT_TARGET=0)))
    split = ms(lambda: causal_attention(q, k, v, kb, scale, out=y))
    ref = causal_attention(q, k, v, kb, scale, config=dict(SPLIT_TARGET=0))
    diff = (causal_attention(q, k, v, kb, scale) - ref).abs().max().item()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch_ms = ms(lambda: sdpa(q, k, v, scale=scale, enable_gqa=True))
    cfg = block_config(d, "float16", nq // nkv, b * nkv)
    chunk = split_keys(t, b * nkv, cfg["BLOCK_N"], cfg["SPLIT_TARGET"])
    cache_bytes = 2 * b * nkv * t * d * 2
    gbps = lambda m: cache_bytes / m / 1e6
    return dict(batch=b, cache=t, heads=nq, kv_heads=nkv, head_dim=d, chunk_keys=chunk,
                chunks=split_chunks(t, chunk), one_pass_ms=one_pass, split_ms=split, sdpa_ms=torch_ms,
                split_speedup=one_pass / split, vs_sdpa=torch_ms / split, split_gbps=gbps(split),
                one_pass_gbps=gbps(one_pass), sdpa_gbps=gbps(torch_ms),
                split_ceiling_fraction=gbps(split) / CEILING_GBPS, max_abs_diff_split_vs_one_pass=diff,
                cache_bytes=cache_bytes)


def main(argv=None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x1024,16x1024,1x4096,16x4096,1x16384,4x32768", help="BATCHxCACHE,...")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    rows = []
    print(f"{'B':>3} {'T':>6} {'chunks':>6} {'1 pass us':>9} {'split us':>9} {'sdpa us':>8} {'split x':>7} "
          f"{'vs sdpa':>7} {'split GB/s':>10} {'% ceiling':>9}")
    for shape in args.shapes.split(","):
        b, t = map(int, shape.split("x"))
        row = _one_shape(b, t + 1, args.heads, args.kv_heads, args.head_dim)  # the cache plus the new token
        rows.append(row)
        print(f"{b:>3} {row['cache']:>6} {row['chunks']:>6} {row['one_pass_ms'] * 1e3:>9.1f} "
              f"{row['split_ms'] * 1e3:>9.1f} {row['sdpa_ms'] * 1e3:>8.1f} {row['split_speedup']:>6.2f}x "
              f"{row['vs_sdpa']:>6.2f}x {row['split_gbps']:>10.0f} {100 * row['split_ceiling_fraction']:>8.1f}%")
    with open(args.json, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
