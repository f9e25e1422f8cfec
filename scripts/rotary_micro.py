"""QKVRotaryCache and QKVNormRotaryCache as the library compiles them, rope_rows against rope_halves (GPU).

Session 28's SASS audit (scripts/sass_memory_audit.py) found the aligned rotary specs loading 24 of their ~25
values a thread as 2-byte scalars: rope_rows builds the partner channel and the cos/sin index with tl.where on
runtime flags, which the alignment analysis cannot follow. Session 29's half-split specs (rope_halves: R = D =
BLOCK_D, not interleaved) read each row as two halves at constant offsets and load 64-bit vectors. Here both, and
the half split at wider tiles (--tiles: elements a program, BLOCK_S = tile / BLOCK_D), each "AOT-like": compiled
as the library's spec is (the ints the spec does not declare divisible by 16 left unspecialised, which the JIT
would otherwise specialise unasked), on the Llama-1B and Qwen3-0.6B shapes. Every variant's output is checked
against rope_rows' before it is timed.

Timing: triton.testing.do_bench_cudagraph (median of CUDA-graph replays). Bytes: the new rows read and written,
one cos and sin row a position, the past copied into present (read and written); GB/s and % of --ceiling-gbs
(the copy ceiling: H200 ~4080, H100 ~3000).

    python scripts/rotary_micro.py [--shapes 1x512x0,8x512x0,1x1x1024] [--json OUT.jsonl]
"""

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ort_triton.kernels.qkv_rotary_cache import qkv_norm_rotary_cache_fwd, qkv_rotary_cache_fwd  # noqa: E402
from ort_triton.ops.qkv_rotary_cache import BLOCK_C  # noqa: E402
from ort_triton.ops.rotary import NUM_WARPS, TILE  # noqa: E402

# The aligned specs declare the pointers, D, cos_b and cos_s divisible by 16; every other int is a plain runtime
# value in the library (P = 0 or S = 1 included), so the JIT must not specialise it here either.
PLAIN = ["NQ", "NKV", "S", "P", "R", "per_pair", "interleaved", "n_new"]
KERNELS = {"rotary": triton.jit(do_not_specialize=PLAIN)(qkv_rotary_cache_fwd.fn),
           "norm_rotary": triton.jit(do_not_specialize=PLAIN)(qkv_norm_rotary_cache_fwd.fn)}
MODELS = {"llama-1b": (32, 8, 64, "rotary"), "qwen3-0.6b": (16, 8, 128, "norm_rotary")}  # NQ, NKV, D, kernel


def run(kind, qkv, cos, sin, pk, pv, gq, gk, outs, nq, nkv, s, p, d, half, block_s):
    """One launch as the planner makes it: n_new tiles of new rows, then the past's copy programs."""
    b = qkv.shape[0]
    n_new = triton.cdiv(s, block_s) * (nq + 2 * nkv) * b
    grid = (n_new + 2 * b * nkv * triton.cdiv(p * d, BLOCK_C),)
    scalars = (nq, nkv, s, p, d, d, 0, d, 0, 0, n_new)  # R = D, cos [1, S, D]: cos_b 0, cos_s D, per channel
    blocks = dict(BLOCK_S=block_s, BLOCK_D=d, BLOCK_C=BLOCK_C, HALF_SPLIT=half, num_warps=NUM_WARPS)
    if kind == "rotary":
        KERNELS[kind][grid](qkv, cos, sin, pk, pv, *outs, *scalars, **blocks)
    else:
        KERNELS[kind][grid](qkv, cos, sin, pk, pv, gq, gk, *outs, *scalars, 1e-6, **blocks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--shapes", default="1x512x0,8x512x0,1x1x1024,16x1x1024", help="BxSxP,...")
    p.add_argument("--tiles", default=f"{TILE},{2 * TILE},{4 * TILE}", help="half-split tile sizes to try")
    p.add_argument("--ceiling-gbs", type=float, default=4080.0)
    p.add_argument("--json")
    a = p.parse_args()
    torch.manual_seed(0)
    dev, t = "cuda", torch.float16
    rows = []
    for model in a.models.split(","):
        nq, nkv, d, kind = MODELS[model]
        for shape in a.shapes.split(","):
            b, s, past = (int(v) for v in shape.split("x"))
            qkv = torch.randn(b, s, (nq + 2 * nkv) * d, device=dev, dtype=t)
            cos, sin = (torch.randn(1, s, d, device=dev, dtype=t) for _ in range(2))
            pk, pv = (torch.randn(b, nkv, past, d, device=dev, dtype=t) for _ in range(2))
            gq, gk = (torch.rand(d, device=dev, dtype=t) + 0.5 for _ in range(2))
            es = qkv.element_size()
            nbytes = es * (2 * qkv.numel() + 2 * cos.numel() + 4 * pk.numel())
            variants = [("rope_rows", 0, TILE // d)] + [(f"rope_halves tile {tile}", 1, tile // d)
                                                       for tile in map(int, a.tiles.split(","))]
            ref = None
            for name, half, block_s in variants:
                outs = (torch.full((b, nq, s, d), float("nan"), device=dev, dtype=t),
                        *(torch.full((b, nkv, past + s, d), float("nan"), device=dev, dtype=t) for _ in range(2)))
                fn = functools.partial(run, kind, qkv, cos, sin, pk, pv, gq, gk, outs, nq, nkv, s, past, d, half,
                                       block_s)
                fn()
                torch.cuda.synchronize()
                if ref is None:
                    ref = [o.clone() for o in outs]
                ok = all(torch.equal(o, r) for o, r in zip(outs, ref))
                if not ok:  # the halves sum the norm's squares in another order: a last-bit difference at most
                    ok = all(torch.allclose(o.float(), r.float(), rtol=1e-2, atol=1e-2) for o, r in zip(outs, ref))
                us = do_bench_cudagraph(fn, rep=200) * 1e3
                row = dict(model=model, kernel=kind, shape=shape, variant=name, block_s=block_s, us=round(us, 2),
                           bytes=nbytes, gbs=round(nbytes / us / 1e3, 1),
                           ceiling_pct=round(100 * nbytes / us / 1e3 / a.ceiling_gbs, 1), matches_rope_rows=ok)
                rows.append(row)
            base = next(r["us"] for r in rows[-len(variants):] if r["variant"] == "rope_rows")
            for r in rows[-len(variants):]:
                r["speedup"] = round(base / r["us"], 3)
                print(f"{model:11s} {shape:10s} {r['variant']:22s} BLOCK_S {r['block_s']:3d} {r['us']:8.2f} us "
                      f"{r['gbs']:7.1f} GB/s {r['ceiling_pct']:5.1f}%  {r['speedup']:.3f}x"
                      f"{'' if r['matches_rope_rows'] else '  MISMATCH'}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
