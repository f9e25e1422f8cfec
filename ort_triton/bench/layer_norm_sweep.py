"""Sweep the LayerNorm kernel's launch configuration (rows per program, warps) per hidden size on the GPU:
the evidence behind ort_triton.ops.layer_norm.launch_config. A size in THIRDS is swept in both layouts,
its own (three blocks, rows `layout=thirds`) and the one power-of-two block with the tail masked
(`layout=block`), so the table can say what the layout buys; `--evict 0,1` times each config with and
without the kernel's eviction hints.

    python -m ort_triton.bench.layer_norm_sweep --rows 65536 --hidden 768,1024,4096,8192 --json OUT.json

Each candidate is timed in a CUDA graph of its launches (triton.testing.do_bench_cudagraph, median), so
4096-row shapes (~10 us a launch) measure the kernel and not Triton's Python launcher; AddLayerNorm's
bias is a real input, as in the library.
"""

from __future__ import annotations

import argparse
import functools
import json

from ..ops.layer_norm import block_layout, launch_config, launch_evict, layout
from ..ops.tune_space import layout_width


def main(argv=None) -> None:
    import torch
    import triton

    from ..kernels.layer_norm import layer_norm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="4096,65536")
    p.add_argument("--hidden", default="768,1024,4096,8192")
    p.add_argument("--modes", default="plain,residual,residual+sum")
    p.add_argument("--rows-per-program", default="1,2,4,8,16", help="the ROWS values to try")
    p.add_argument("--warps", default="1,2,4,8,16", help="the num_warps values to try")
    p.add_argument("--current", action="store_true", help="only the launch table's (ROWS, warps) for each "
                   "shape and mode, in place of --rows-per-program x --warps")
    p.add_argument("--evict", default="0", help="the kernel's EVICT values to try for each config (0,1)")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    out = []
    for n in map(int, args.rows.split(",")):
        for h in map(int, args.hidden.split(",")):
            block = block_layout(h)
            layouts = {"thirds": layout(h), "block": block} if layout(h) != block else {"block": block}
            x = torch.randn(n, h, device="cuda", dtype=torch.float16)
            r = torch.randn_like(x)
            g, b, c = (torch.randn(h, device="cuda", dtype=x.dtype) for _ in range(3))
            for mode, moved in (("plain", 2), ("residual", 3), ("residual+sum", 4)):
                if mode not in args.modes.split(","):
                    continue
                skip = r if mode != "plain" else None
                for name, lay in layouts.items():
                    width = layout_width(lay)
                    results = {}
                    cur = (*launch_config(width, mode != "plain", mode == "residual+sum", n_rows=n),
                           launch_evict(width, mode != "plain", mode == "residual+sum", n_rows=n))
                    grid = ([cur[:2]] if args.current else
                            [(r, w) for r in map(int, args.rows_per_program.split(","))
                             for w in map(int, args.warps.split(","))])
                    for rows, warps in grid:
                        if rows * width > 32768 or rows * lay["BLOCK_H"] < 32 * warps:
                            continue
                        for evict in map(int, args.evict.split(",")):
                            fn = functools.partial(layer_norm, x, g, b, skip, store_sum=mode == "residual+sum",
                                                   bias=c if skip is not None else None, config=(rows, warps),
                                                   lay=lay, evict=bool(evict))
                            fn()  # compile outside the graph capture
                            results[(rows, warps, evict)] = triton.testing.do_bench_cudagraph(
                                fn, rep=100, return_mode="median")
                    best = min(results, key=results.get)
                    gbs = functools.partial(lambda ms, nbytes: nbytes / ms / 1e6, nbytes=moved * x.numel() * 2)
                    print(f"{n:6} {h:5} {mode:13} layout={name:6} best rows={best[0]:2} warps={best[1]:2} "
                          f"evict={best[2]} "
                          f"{results[best] * 1e3:8.2f} us {gbs(results[best]):5.0f} GB/s | current {cur} "
                          f"{results.get(cur, float('nan')) * 1e3:8.2f} us", flush=True)
                    out.append(dict(rows=n, hidden=h, mode=mode, layout=name, best=best, best_us=results[best] * 1e3,
                                    current=cur, current_us=results.get(cur, float("nan")) * 1e3,
                                    all={"x".join(map(str, k)): v * 1e3 for k, v in results.items()}))
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
