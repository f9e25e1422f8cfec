"""Two runtimes on one model, timed in alternating rounds: is B faster than A, beyond the run's noise?

    python -m ort_triton.bench.ab --hf-config bert-base --a ort_triton_cuda_graph \
        --b ort_triton_tuned_cuda_graph --shapes 1x128,8x512 --json OUT.json

`ort-triton bench` times one runtime after the other, each in a fresh session; on the H200 two runs of the
same library then differ by 2-5% at some shapes (session 9: the default and the tuned library ran the same
kernels at 8x2048 and came out 0.982x). Here both sessions live side by side and take turns: each round
times `iters` calls of one, then of the other, the order flipped every round so a clock or thermal drift
falls on both. B's speedup over A is the median over rounds of (A's median / B's median in that round);
the spread of those per-round ratios is the noise the verdict has to beat. `--b` may name A's runtime
again: the A/A run measures that noise directly.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import tempfile

import onnx


def compare(a, b, model, shape, inputs, clock, rounds: int, iters: int, warmup: int) -> dict:
    """Time runtimes `a` and `b` (bench Runtime objects) on one shape in `rounds` alternating rounds."""
    runners = [a.prepare(model, shape, inputs)]
    try:
        runners.append(b.prepare(model, shape, inputs))
        for _ in range(warmup):
            for r in runners:
                r.run()
        medians = ([], [])
        for k in range(rounds):
            for i in ((0, 1) if k % 2 == 0 else (1, 0)):
                medians[i].append(statistics.median(clock.time(runners[i].run) for _ in range(iters)))
    finally:
        for r in runners:
            r.close()
    ratios = sorted(x / y for x, y in zip(*medians))
    return dict(batch=shape[0], seq=shape[1], a=a.name, b=b.name, rounds=rounds, iters=iters,
                a_ms=statistics.median(medians[0]), b_ms=statistics.median(medians[1]),
                speedup=statistics.median(ratios), ratio_min=ratios[0], ratio_max=ratios[-1],
                a_round_ms=medians[0], b_round_ms=medians[1])


def summary(rows: list[dict]) -> dict:
    s = [r["speedup"] for r in rows]
    return dict(geomean=math.exp(sum(map(math.log, s)) / len(s)), min=min(s), max=max(s))


def main(argv=None) -> int:
    from .harness import Clock, _graph_inputs, _vocab_size, environment, load_model, parse_shapes, random_inputs
    from .runtimes import RUNTIMES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-config", default="bert-base")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--a", default="ort_triton_cuda_graph", help="the baseline runtime")
    p.add_argument("--b", default="ort_triton_tuned_cuda_graph", help="the runtime whose speedup over A is wanted")
    p.add_argument("--shapes", default="1x128,8x128,32x128,1x512,8x512,32x512,8x2048")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=30, help="timed calls per runtime and round")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", help="write the rows and the summary here")
    args = p.parse_args(argv)
    for name in (args.a, args.b):
        if name not in RUNTIMES:
            p.error(f"unknown runtime {name!r}; known: {', '.join(RUNTIMES)}")
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        p.error("need --rounds >= 1, --iters >= 1, --warmup >= 0")
    shapes = parse_shapes(args.shapes)
    a, b = RUNTIMES[args.a](), RUNTIMES[args.b]()
    gpu, versions = environment(args.device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ort_triton_ab_") as work:
        model = load_model(None, args.hf_config, args.dtype, args.device, "dynamo", pathlib.Path(work), shapes)
        for rt in (a, b):
            reason = rt.available(model)
            if reason:
                print(f"error: {rt.name} cannot run here: {reason}", file=sys.stderr)
                return 2
        proto = onnx.load(str(model.onnx), load_external_data=False)
        spec, vocab = _graph_inputs(proto), _vocab_size(proto, model.config)
        clock = Clock(args.device)
        print(f"{model.name} {model.dtype} on {gpu or 'cpu'}: B={b.name} against A={a.name}, "
              f"{args.rounds} alternating rounds of {args.iters} calls each", flush=True)
        for shape in shapes:
            row = compare(a, b, model, shape, random_inputs(spec, *shape, vocab), clock, args.rounds, args.iters,
                          args.warmup)
            rows.append(row)
            print(f"{shape[0]}x{shape[1]:<6} A {row['a_ms']:8.3f} ms  B {row['b_ms']:8.3f} ms  B/A speedup "
                  f"{row['speedup']:.3f}x (rounds {row['ratio_min']:.3f}-{row['ratio_max']:.3f})", flush=True)
    total = summary(rows)
    print(f"speedup geomean {total['geomean']:.3f}x, min {total['min']:.3f}x, max {total['max']:.3f}x")
    if args.json:
        out = dict(model=args.hf_config, dtype=args.dtype, gpu=gpu, versions=versions, summary=total, rows=rows,
                   command=" ".join(["python -m ort_triton.bench.ab", *(argv if argv is not None else sys.argv[1:])]))
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
