"""Decode attention launch configs on the GPU: our CausalAttention kernel (one new token over a KV cache) at
Llama-1B's heads over key block, warps, stages and the split (SPLIT_TARGET programs, SPLIT_MIN_KEYS keys a
chunk at least), against the library's default config and PyTorch's sdpa (enable_gqa), same inputs, each
runner replayed in a CUDA graph (triton.testing.do_bench_cudagraph, median). --merge times the split's merge
variants side by side, each config once per variant: `loop` (chunk after chunk, MERGE_BLOCK 0), `blocked` (the
library's MERGE_BLOCK, ops/causal_attention.py merge_block), `blockedN` (N chunks at a time, a power of two) or
`fused` (the library's MERGE_BLOCK in the chunks' launch: FUSED_MERGE, one launch instead of two).

    python3 scripts/decode_attention_sweep.py --shapes 1x1024,16x1024,1x4096 --json OUT.jsonl
    python3 scripts/decode_attention_sweep.py --block-n 128 --warps 4 --stages 2 --split-target 128 \
        --split-min-keys 256 --merge loop,blocked,blocked16,fused --json OUT.jsonl

Why: a Llama-1B decode step with CUDA graphs spends 172 us of its 1.27 ms of GPU time in this kernel (two
launches a layer, 5.4 us each at 1x1024) for 2 MB of cache a layer (session 14's profile). One row per
(shape, config) in the JSONL; the best few per shape printed beside the default and sdpa.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json


def main(argv=None) -> None:
    import torch
    import triton

    from ort_triton.kernels.causal_attention import causal_attention
    from ort_triton.ops.causal_attention import SPLIT_MIN_KEYS, block_config, merge_block, split_chunks, split_keys

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x1024,16x1024,1x4096,16x4096")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-n", default="64,128")
    p.add_argument("--warps", default="2,4")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--split-target", default="0,128,256,512,1024")
    p.add_argument("--split-min-keys", default="64,128,256")
    p.add_argument("--merge", default="blocked", help="loop, blocked, blockedN, fused (comma-separated)")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    ints = lambda s: [int(v) for v in s.split(",")]
    nq, nkv, d = args.heads, args.kv_heads, args.head_dim
    # MERGE_BLOCK by variant; None: the library's for the config's warps (left to causal_attention)
    merges = {name: 0 if name == "loop" else None if name in ("blocked", "fused") else int(name[len("blocked"):])
              for name in args.merge.split(",")}
    with open(args.json, "w") as out:  # one row a line, flushed per shape: a cut run keeps what it timed
        for shape in args.shapes.split(","):
            b, t = map(int, shape.split("x"))
            default = block_config(d, "float16", nq // nkv, b * nkv)  # the wide spec from DECODE_WIDE programs on
            t += 1  # the cache plus the new token
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float16)
                       for shape in ((b, nq, 1, d), (b, nkv, t, d), (b, nkv, t, d)))
            kb = torch.zeros(b, t, device="cuda", dtype=torch.float16)
            y = torch.empty(b, 1, nq * d, device="cuda", dtype=torch.float16)
            scale = d**-0.5
            ref = causal_attention(q, k, v, kb, scale, config=dict(SPLIT_TARGET=0)).float()

            def ms(fn):
                fn()  # compile outside the capture
                return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")

            ours = functools.partial(causal_attention, q, k, v, kb, scale, out=y)
            rows = [dict(config="default", us=1e3 * ms(ours), split_target=default["SPLIT_TARGET"],
                         chunk=split_keys(t, b * nkv, default["BLOCK_N"], default["SPLIT_TARGET"], SPLIT_MIN_KEYS))]
            sdpa = torch.nn.functional.scaled_dot_product_attention
            torch_sdpa = functools.partial(sdpa, q, k, v, scale=scale, enable_gqa=True)
            rows.append(dict(config="sdpa", us=1e3 * ms(torch_sdpa)))
            grid = itertools.product(ints(args.block_n), ints(args.warps), ints(args.stages), ints(args.split_target),
                                     ints(args.split_min_keys))
            for (bn, w, st, target, min_keys), (merge, merge_blk) in itertools.product(grid, merges.items()):
                if target == 0 and min_keys != ints(args.split_min_keys)[0]:
                    continue  # one pass: the minimum does not matter
                chunk = split_keys(t, b * nkv, bn, target, min_keys)
                if not chunk and merge != next(iter(merges)):
                    continue  # one pass: no merge to compare
                cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=st, SPLIT_TARGET=target, SPLIT_MIN_KEYS=min_keys)
                cfg.update({} if merge_blk is None else dict(MERGE_BLOCK=merge_blk))
                cfg.update(FUSED_MERGE=int(merge == "fused"))
                try:
                    got = causal_attention(q, k, v, kb, scale, config=cfg).float()
                    err = (got - ref).abs().max().item()
                    us = 1e3 * ms(functools.partial(ours, config=cfg))
                except Exception as e:  # noqa: BLE001 (out of shared memory, a config that does not compile)
                    rows.append(dict(config=cfg, error=str(e)[:200]))
                    continue
                rows.append(dict(config=cfg, merge=merge if chunk else None,
                                 merge_block=merge_block(d, default["BLOCK_M"], w) if merge_blk is None else merge_blk,
                                 us=us, max_abs_diff=err, chunk=chunk, chunks=split_chunks(t, chunk)))
            cache_bytes = 2 * b * nkv * t * d * 2
            for row in rows:
                row.update(shape=shape, cache_bytes=cache_bytes)
                if "us" in row:
                    row["gb_s"] = cache_bytes / row["us"] / 1e3
                out.write(json.dumps(row) + "\n")
            out.flush()
            ok = sorted((r for r in rows if "us" in r and isinstance(r["config"], dict)), key=lambda r: r["us"])
            print(f"{shape}: default {rows[0]['us']:.2f} us (chunk {rows[0]['chunk']}), sdpa {rows[1]['us']:.2f} us; "
                  "best:")
            for row in ok[:5]:
                print(f"   {row['us']:7.2f} us  {row['gb_s']:6.0f} GB/s  chunk {row['chunk']:5}  {row['config']}  "
                      f"|d| {row['max_abs_diff']:.1e}")
            best = {m: min((r for r in ok if r["merge"] == m), key=lambda r: r["us"], default=None) for m in merges}
            split = [f"{m} {r['us']:.2f} us ({r['chunks']} chunks, merge block {r['merge_block']})"
                     for m, r in best.items() if r]
            print("   best split by merge: " + (", ".join(split) or "none (no config split this shape)"))


if __name__ == "__main__":
    main()
