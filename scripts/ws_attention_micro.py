"""The warp-specialised attention kernel (kernels/attention.py `_attention_ws`, the WS tuning candidates) against
the library's built-in kernel and torch's sdpa, on the H200: BERT-base heads (12 x 64) packed, as the library
runs BERT, and unpacked at head dims 64 and 128; fp16; Triton JIT, CUDA-graph replays, median us; TFLOP/s as
4 B N S^2 D / time. Each WS config's output is checked against the built-in kernel's first (max abs diff under
1e-2, or the row says "wrong"). One JSON line per shape.

    python scripts/ws_attention_micro.py [--shapes 1x128,8x512,...] [--json OUT.jsonl]
"""
import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from ort_triton.kernels.attention import attention, packed_attention
from ort_triton.ops.attention import TUNING

SHAPES = "1x128,8x128,32x128,1x512,8x512,32x512,8x2048"


def bench(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def time_shape(b: int, s: int, heads: int, d: int, packed: bool) -> dict:
    h = heads * d
    g = torch.Generator(device="cuda").manual_seed(0)
    kb = torch.zeros(b, s, device="cuda", dtype=torch.half)
    kb[0, s - s // 4:] = float("-inf")  # one padded row, as a batch of unequal sentences has
    y = torch.empty(b, s, h, device="cuda", dtype=torch.half)
    if packed:
        qkv = torch.randn(b, s, 3 * h, device="cuda", generator=g).half()
        bias = torch.randn(3 * h, device="cuda", generator=g).half()
        q, k, v = qkv.split(h, dim=-1)
        run = lambda cfg=None: packed_attention(qkv, kb, bias, heads, d**-0.5, out=y, config=cfg)  # noqa: E731
    else:
        q, k, v = (torch.randn(b, s, h, device="cuda", generator=g).half() for _ in range(3))
        run = lambda cfg=None: attention(q, k, v, kb, heads, d**-0.5, out=y, config=cfg)  # noqa: E731
    flops = 4 * b * heads * s * s * d
    row = {"shape": f"{b}x{s}", "heads": heads, "head_dim": d, "packed": packed}
    run()
    ref = y.clone()
    row["library_us"] = bench(run)
    # torch's sdpa on the heads layout, with the key mask (its memory-efficient kernel) and without (flash/cuDNN)
    qh, kh, vh = (t.reshape(b, s, heads, d).transpose(1, 2).contiguous() for t in (q, k, v))
    mask = kb[:, None, None, :].expand(b, heads, s, s)
    row["sdpa_masked_us"] = bench(lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask))
    row["sdpa_nomask_us"] = bench(lambda: F.scaled_dot_product_attention(qh, kh, vh))
    best = None
    for cfg in TUNING.candidates("float16", (d, int(s % 16 == 0), s, b * heads), 90, packed):
        if not cfg.get("WS"):
            continue
        name = f"ws {cfg['BLOCK_M']}x{cfg['BLOCK_N']}/s{cfg['num_stages']}"
        try:
            y.fill_(float("nan"))
            run(cfg)
            torch.cuda.synchronize()
            err = (y.float() - ref.float()).abs().max().item()
            if not err < 1e-2:
                row[name] = f"wrong ({err})"
                continue
            row[name] = bench(lambda cfg=cfg: run(cfg))
            best = row[name] if best is None else min(best, row[name])
        except Exception as exc:  # noqa: BLE001  (out of shared memory, a compile failure: say so, go on)
            row[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    row["library_tflops"] = flops / row["library_us"] / 1e6
    if best is not None:
        row["ws_best_us"] = best
        row["ws_best_tflops"] = flops / best / 1e6
        row["ws_speedup"] = row["library_us"] / best
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--json")
    args = ap.parse_args()
    from ort_triton.ops.attention import require_ws

    try:  # the kernel is experimental: its first launch on the H200 did not return
        require_ws()
    except ValueError as e:
        ap.error(str(e))
    rows = []
    for shape in args.shapes.split(","):
        b, s = map(int, shape.split("x"))
        for heads, d, packed in ((12, 64, True), (12, 64, False), (8, 128, False)):
            row = time_shape(b, s, heads, d, packed)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
