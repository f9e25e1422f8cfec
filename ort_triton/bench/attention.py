"""Attention kernel speed on the GPU: our flash-attention kernel (through Triton's JIT, the same source the
library compiles) against PyTorch's scaled_dot_product_attention, same inputs, fp16.

    python -m ort_triton.bench.attention --json OUT.json

FLOPs counted: 4 * B * N * Sq * Skv * D (the two GEMMs), over the measured time (median; each
runner's launches replayed in a CUDA graph, triton.testing.do_bench_cudagraph, so small shapes time the
kernels and not the Python launchers).
Ours takes Q/K/V in [B, S, N*D] with a per-key bias (a padding mask); PyTorch gets [B, N, S, D] views of
the same memory, once without a mask (its flash path: the bar) and once with the padding mask as an
additive [B, 1, 1, S] bias (its memory-efficient path: what a masked BERT batch needs).
"""

from __future__ import annotations

import argparse
import json


def _one_shape(b: int, s: int, n: int, d: int) -> dict:
    import torch
    import triton

    from ..kernels.attention import attention

    q, k, v = (torch.randn(b, s, n * d, device="cuda", dtype=torch.float16) for _ in range(3))
    lengths = torch.randint(s // 2, s + 1, (b,), device="cuda")
    keep = torch.arange(s, device="cuda")[None, :] < lengths[:, None]
    key_bias = torch.where(keep, 0.0, torch.finfo(torch.float16).min).to(torch.float16)
    qh, kh, vh = (t.view(b, s, n, d).transpose(1, 2) for t in (q, k, v))  # [B, N, S, D] views, no copy
    scale = d**-0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    def ms(fn):
        fn()  # compile (ours) and pick kernels (sdpa) outside the graph capture
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")

    bias = torch.randn(n * d, device="cuda", dtype=torch.float16)  # the K and V projections' (K's is not read)
    ours = ms(lambda: attention(q, k, v, key_bias, n, scale, k_bias=bias, v_bias=bias))
    flash = ms(lambda: sdpa(qh, kh, vh, scale=scale))
    masked = ms(lambda: sdpa(qh, kh, vh, attn_mask=key_bias[:, None, None, :], scale=scale))
    flops = 4 * b * n * s * s * d
    return dict(batch=b, seq=s, heads=n, head_dim=d, ours_ms=ours, sdpa_flash_ms=flash, sdpa_masked_ms=masked,
                ours_tflops=flops / ours / 1e9, flops=flops)


def main(argv=None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x128,8x512,32x512,8x2048", help="BATCHxSEQ,...")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    n, d = args.heads, args.head_dim
    rows = []
    print(f"{'B':>3} {'S':>5} {'ours ms':>8} {'TFLOP/s':>8} {'sdpa flash':>10} {'sdpa masked':>11} "
          f"{'ours/flash':>10} {'ours/masked':>11}")
    for shape in args.shapes.split(","):
        b, s = map(int, shape.split("x"))
        row = _one_shape(b, s, n, d)
        rows.append(row)
        print(f"{b:3} {s:5} {row['ours_ms']:8.3f} {row['ours_tflops']:8.1f} {row['sdpa_flash_ms']:10.3f} "
              f"{row['sdpa_masked_ms']:11.3f} {row['sdpa_flash_ms'] / row['ours_ms']:10.2f} "
              f"{row['sdpa_masked_ms'] / row['ours_ms']:11.2f}", flush=True)
    with open(args.json, "w") as fh:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
