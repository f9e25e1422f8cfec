"""Programmatic dependent launch (PDL) on a chain of small kernels, in a CUDA graph, on the GPU.

Why: with CUDA graphs a decode step is a chain of ~200 kernels, most of them a few microseconds long (session 14's
profile: an RMSNorm of one 2048-wide row takes 2.4 us). On sm_90 a kernel launched with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may start while the kernel before it finishes; it must run
`griddepcontrol.wait` (Triton: gdc_wait) before it touches anything the earlier kernel writes or reads. This
measures what that saves before the native launcher and every kernel take it on.

Chains (captured once in a torch CUDA graph, replayed; us per kernel of ours, median of rounds):
- `norms`: N RMSNorm-like kernels back to back (one [ROWS, 2048] fp16 tensor, in -> out -> in ...);
- `gemv`: the decode pattern, cuBLAS GEMV (torch.mm, 1 x 2048 @ 2048 x 2048) then one of ours, N times. cuBLAS is
  launched without the attribute, as ORT launches it; only our kernel can start early.
Modes of our kernel: `plain` (no gdc, no attribute), `wait` (gdc_wait first, attribute on), `wait_trigger` (then
gdc_launch_dependents at once, so that the next of ours may start too), `prefetch` (gamma loaded before the wait:
a weight no earlier kernel writes).

    python scripts/pdl_micro.py [--n 64] [--rows 1,16] [--json OUT.jsonl]
"""

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def norm_kernel(X, G, Y, H, eps, BLOCK: tl.constexpr, MODE: tl.constexpr):
    # MODE 0 plain, 1 wait, 2 wait + trigger, 3 gamma before the wait + trigger
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    if MODE == 3:
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if MODE >= 1:
        gdc_wait()
    if MODE >= 2:
        gdc_launch_dependents()
    x = tl.load(X + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    if MODE != 3:
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(Y + row * H + offs, (x * r * g).to(Y.dtype.element_ty), mask=mask)


MODES = {"plain": 0, "wait": 1, "wait_trigger": 2, "prefetch": 3}


def norm(x, g, y, mode):
    rows, h = x.shape
    norm_kernel[(rows,)](x, g, y, h, 1e-6, BLOCK=triton.next_power_of_2(h), MODE=MODES[mode], num_warps=4,
                         launch_pdl=mode != "plain")


def build(chain, mode, n, rows, h=2048):
    """The chain's buffers and its step; the step's result lands in `a` (an even number of norms)."""
    torch.manual_seed(0)
    a = torch.randn(rows, h, device="cuda", dtype=torch.float16)
    b = torch.empty_like(a)
    g = torch.rand(h, device="cuda", dtype=torch.float16) + 0.5
    w = torch.randn(h, h, device="cuda", dtype=torch.float16) / h**0.5

    def step():
        src, dst = a, b
        for _ in range(n):
            if chain == "norms":
                norm(src, g, dst, mode)
                src, dst = dst, src
            else:
                torch.mm(a, w, out=b)
                norm(b, g, a, mode)

    def reference(x):
        for _ in range(n):
            xf = (x @ w if chain == "gemv" else x).float()
            x = (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6) * g.float()).half()
        return x

    return a, step, reference


def time_chain(chain, mode, n, rows, rounds=7, replays=200):
    """(median, min, max) us per replay of the captured chain, and the output of one replay."""
    a, step, reference = build(chain, mode, n, rows)
    start = a.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    a.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    got = a.clone()
    want = reference(start)
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(replays):
            graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000 / replays)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    return statistics.median(times), min(times), max(times), got, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = open(args.json, "w") if args.json else None
    for chain in ("norms", "gemv"):
        for rows in (int(r) for r in args.rows.split(",")):
            results = {}
            for mode in MODES:
                med, lo, hi, got, err = time_chain(chain, mode, args.n, rows)
                results[mode] = (med, got)
                row = {"chain": chain, "rows": rows, "n": args.n, "mode": mode, "us_step": med, "us_min": lo,
                       "us_max": hi, "us_per_kernel_of_ours": med / args.n, "rel_err_vs_fp32": err}
                if mode != "plain":
                    ref = results["plain"][1].float()
                    row["max_abs_diff_vs_plain"] = (got.float() - ref).abs().max().item()  # must be 0
                    row["speedup_vs_plain"] = results["plain"][0] / med
                print(json.dumps(row), flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
