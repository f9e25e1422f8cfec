"""Sweep the LayerNorm kernel's launch configuration (rows per program, warps) per hidden size on the GPU:
the evidence behind ort_triton.ops.layer_norm.launch_config.

    python -m ort_triton.bench.layer_norm_sweep --rows 65536 --hidden 768,1024,4096,8192 --json OUT.json

Each candidate is timed in a CUDA graph of its launches (triton.testing.do_bench_cudagraph, median), so
4096-row shapes (~10 us a launch) measure the kernel and not Triton's Python launcher; AddLayerNorm's
bias is a real input, as in the library.
"""

from __future__ import annotations

import argparse
import functools
import json

from ..ops.layer_norm import BLOCKS, launch_config


def main(argv=None) -> None:
    import torch
    import triton

    from ..kernels.layer_norm import layer_norm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="4096,65536")
    p.add_argument("--hidden", default="768,1024,4096,8192")
    p.add_argument("--modes", default="plain,residual,residual+sum")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    out = []
    for n in map(int, args.rows.split(",")):
        for h in map(int, args.hidden.split(",")):
            block = next(b for b in BLOCKS if b >= h)
            x = torch.randn(n, h, device="cuda", dtype=torch.float16)
            r = torch.randn_like(x)
            g, b, c = (torch.randn(h, device="cuda", dtype=x.dtype) for _ in range(3))
            for mode, moved in (("plain", 2), ("residual", 3), ("residual+sum", 4)):
                if mode not in args.modes.split(","):
                    continue
                skip = r if mode != "plain" else None
                results = {}
                for rows in (1, 2, 4, 8, 16):
                    for warps in (1, 2, 4, 8, 16):
                        if rows * block > 32768 or rows * block < 32 * warps:
                            continue
                        fn = functools.partial(layer_norm, x, g, b, skip, store_sum=mode == "residual+sum",
                                               bias=c if skip is not None else None, config=(rows, warps))
                        fn()  # compile outside the graph capture
                        results[(rows, warps)] = triton.testing.do_bench_cudagraph(fn, rep=100,
                                                                                   return_mode="median")
                best = min(results, key=results.get)
                cur = launch_config(block, mode != "plain", mode == "residual+sum")
                gbs = functools.partial(lambda ms, nbytes: nbytes / ms / 1e6, nbytes=moved * x.numel() * 2)
                print(f"{n:6} {h:5} {mode:13} best rows={best[0]:2} warps={best[1]:2} {results[best] * 1e3:8.2f} us "
                      f"{gbs(results[best]):5.0f} GB/s | current {cur} {results.get(cur, float('nan')) * 1e3:8.2f} us",
                      flush=True)
                out.append(dict(rows=n, hidden=h, mode=mode, best=best, best_us=results[best] * 1e3,
                                current=cur, current_us=results.get(cur, float("nan")) * 1e3,
                                all={f"{k[0]}x{k[1]}": v * 1e3 for k, v in results.items()}))
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
