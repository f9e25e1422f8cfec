"""Where the GPU time of one inference goes, per runtime: every CUDA kernel of the process traced with
CUPTI (torch.profiler sees ORT's kernels too: CUPTI is process-wide), grouped into GEMMs (cuBLAS,
CUTLASS), our Triton kernels, and the rest, summed per inference.

    python -m ort_triton.bench.profile --hf-config bert-base --shapes 8x2048,32x512 \
        --runtimes ort_triton,ort_optimizer --json OUT.json

This is how a shape that misses its target is explained: the GEMM time against its FLOPs, the attention
and LayerNorm kernels against theirs, and how much is neither (copies, casts, unfused elementwise ops).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import tempfile

import onnx

# substring of a kernel name -> group; the first that matches wins
GROUPS = (
    ("causal_attention_fwd", "ort_triton causal attention"), ("attention_fwd", "ort_triton attention"),
    ("layer_norm_fwd", "ort_triton layer norm"), ("rms_norm_fwd", "ort_triton rms norm"),
    ("bias_gelu", "ort_triton bias+gelu"), ("rotary_fwd", "ort_triton rotary"), ("silu_mul", "ort_triton silu*mul"),
    ("gemm", "gemm"), ("cutlass", "gemm"), ("xmma", "gemm"), ("cublas", "gemm"), ("nvjet", "gemm"),
    ("fmha", "ort attention"), ("flash", "ort attention"), ("Attention", "ort attention"),
    ("attention", "ort attention"),
    ("LayerNorm", "ort layer norm"), ("layer_norm", "ort layer norm"), ("Gelu", "ort gelu"),
    ("Transpose", "transpose"), ("Cast", "cast"), ("Memcpy", "copy"), ("copy", "copy"),
)


def group_of(kernel: str) -> str:
    return next((g for key, g in GROUPS if key in kernel), "other")


def trace(run, iters: int) -> dict:
    """GPU time per call of `run` (warm: called before), by kernel and by group, from a CUPTI trace of
    `iters` calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    per_kernel = collections.Counter()
    spans = []
    for ev in prof.events():
        if ev.device_type.name == "CUDA":  # a kernel or a copy on the GPU; its time range is in us
            per_kernel[ev.name] += ev.time_range.elapsed_us() / iters  # us per call
            spans.append((ev.time_range.start, ev.time_range.end, ev.name))
    groups = collections.Counter()
    for name, us in per_kernel.items():
        groups[group_of(name)] += us
    idle = idle_gaps(spans, iters)
    return dict(total_us=sum(per_kernel.values()), kernels_per_inference=len(spans) / iters,
                groups=dict(groups.most_common()),
                top=[dict(kernel=k[:160], us=us) for k, us in per_kernel.most_common()],
                idle_us=sum(idle.values()), gaps=[dict(between=k, us=us) for k, us in idle.most_common(12)])


def idle_gaps(spans: list[tuple[float, float, str]], iters: int) -> collections.Counter:
    """The GPU's idle time inside a call, us per call, by the pair of kernels around each gap ("a -> b"): where
    a runtime's wall time exceeds its kernels' sum (a CUDA graph replays with no host in between, so a gap there is
    the GPU's own: a kernel's ramp, a dependency, a copy). Calls are cut apart by count, each the same number of
    kernels; when the count does not divide, no call boundary is known and nothing is reported."""
    spans = sorted(spans)
    per_call = len(spans) // iters if iters and spans and len(spans) % iters == 0 else 0
    gaps = collections.Counter()
    for i in range(1, len(spans) if per_call else 0):
        gap = spans[i][0] - spans[i - 1][1]
        if i % per_call and gap > 0:  # i % per_call == 0: the first kernel of the next call
            gaps[f"{spans[i - 1][2][:60]} -> {spans[i][2][:60]}"] += gap / iters
    return gaps


def wall_us(run, iters: int) -> float:
    """Median wall time of one call of `run` in us (the bench's CUDA-event clock), without the profiler, whose
    CUPTI callbacks slow the host side."""
    import statistics

    from .harness import Clock

    clock = Clock("cuda")
    return statistics.median(clock.time(run) for _ in range(iters)) * 1e3


def profile_runtime(rt, model, shape, inputs, iters: int) -> dict:
    runner = rt.prepare(model, shape, inputs)
    try:
        for _ in range(5):
            runner.run()
        row = trace(runner.run, iters)
        row["wall_us"] = wall_us(runner.run, max(iters, 20))
        # the GPU's idle time inside one inference: launch gaps, host work, syncs between kernels
        row["busy_fraction"] = row["total_us"] / row["wall_us"]
        return dict(row, info=rt.info)
    finally:
        runner.close()


def summary_lines(row: dict) -> list[str]:
    parts = ", ".join(f"{g} {us / 1e3:.2f}" for g, us in row["groups"].items())
    wall = f"wall {row['wall_us'] / 1e3:7.2f} ms, GPU busy {row['busy_fraction']:.0%}; " if "wall_us" in row else ""
    head = f"{wall}GPU {row['total_us'] / 1e3:7.2f} ms/inference in {row['kernels_per_inference']:.0f} kernels: {parts}"
    idle = [f"  idle {row['idle_us'] / 1e3:7.3f} ms between kernels, most:"] if row.get("gaps") else []
    return ([head] + [f"          {t['us'] / 1e3:7.3f} ms  {t['kernel'][:110]}" for t in row["top"][:6]] + idle
            + [f"          {g['us'] / 1e3:7.3f} ms  {g['between'][:110]}" for g in row.get("gaps", [])[:4]])


def main(argv=None) -> None:
    from .harness import _graph_inputs, _vocab_size, load_model, parse_shapes, random_inputs
    from .runtimes import RUNTIMES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-config", default="bert-base")
    p.add_argument("--shapes", default="8x2048,32x512")
    p.add_argument("--runtimes", default="ort_triton,ort_optimizer")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    out = []
    with tempfile.TemporaryDirectory(prefix="ort_triton_profile_") as work:
        model = load_model(None, args.hf_config, args.dtype, "cuda", "dynamo", pathlib.Path(work), shapes)
        proto = onnx.load(str(model.onnx), load_external_data=False)
        spec, vocab = _graph_inputs(proto), _vocab_size(proto, model.config)
        runtimes = [RUNTIMES[n]() for n in args.runtimes.split(",")]
        for shape in shapes:
            inputs = random_inputs(spec, *shape, vocab)
            for rt in runtimes:
                row = dict(shape=f"{shape[0]}x{shape[1]}", runtime=rt.name,
                           **profile_runtime(rt, model, shape, inputs, args.iters))
                out.append(row)
                first, *rest = summary_lines(row)
                print(f"{row['shape']:7} {rt.name:22} {first}", *rest, sep="\n", flush=True)
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
