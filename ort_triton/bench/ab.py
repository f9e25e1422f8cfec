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

Decoders (`--decoder MODEL`, one of ort_triton.decoders.CONFIGS) take the runtimes of bench.decoder and its
shapes, prefill BxS (a prompt of S tokens, no past) and decode BxP (one token over a cache of P positions):

    python -m ort_triton.bench.ab --decoder llama-1b --a ort_triton_cuda_graph \
        --b ort_triton_tuned_cuda_graph --prefill 1x512,8x512 --decode 1x1024,16x1024 --json OUT.json

Any of bench.decoder.ALL may be A or B: ort_triton (dynamic shapes), ort_triton_static and
ort_triton_cuda_graph (one specialised model per shape, shared by both), their tuned-library twins
ort_triton_tuned and ort_triton_tuned_cuda_graph ($ORT_TRITON_TUNED_LIBRARY; CUDA only), ORT's and torch's.
Both runtimes are started once (the same Model: one export, one fused model, the same feeds) and stay alive;
each shape gets a runner of each. A row also says its phase, batch, length (S or P), seq and past, and B's
largest last-token logit difference from A's; a shape one of them cannot run (longer than the position
table, a failed specialisation or session) is a row with status "skipped" or "error" and the reason, and
`summary` is over the rows that ran. Exit status: 2 when A or B cannot run here at all (the JSON still
lists the shapes), 1 when no shape ran.
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

SHAPES = "1x128,8x128,32x128,1x512,8x512,32x512,8x2048"  # the encoder's default


def alternate(runs, clock, rounds: int, iters: int, warmup: int = 0) -> tuple[list[float], list[float]]:
    """Each round's median (ms) of `iters` calls of runs[0] and of runs[1] (callables), the order flipped
    every round, after `warmup` calls of each."""
    for _ in range(warmup):
        for run in runs:
            run()
    medians = ([], [])
    for k in range(rounds):
        for i in ((0, 1) if k % 2 == 0 else (1, 0)):
            medians[i].append(statistics.median(clock.time(runs[i]) for _ in range(iters)))
    return medians


def _result(medians, rounds: int, iters: int) -> dict:
    ratios = sorted(x / y for x, y in zip(*medians))
    return dict(rounds=rounds, iters=iters, a_ms=statistics.median(medians[0]), b_ms=statistics.median(medians[1]),
                speedup=statistics.median(ratios), ratio_min=ratios[0], ratio_max=ratios[-1],
                a_round_ms=medians[0], b_round_ms=medians[1])


def compare(a, b, model, shape, inputs, clock, rounds: int, iters: int, warmup: int) -> dict:
    """Time runtimes `a` and `b` (bench Runtime objects) on one shape in `rounds` alternating rounds."""
    runners = [a.prepare(model, shape, inputs)]
    try:
        runners.append(b.prepare(model, shape, inputs))
        medians = alternate([r.run for r in runners], clock, rounds, iters, warmup)
    finally:
        for r in runners:
            r.close()
    return dict(batch=shape[0], seq=shape[1], a=a.name, b=b.name, **_result(medians, rounds, iters))


def _decoder_row(phase: str, batch: int, n: int, a: str, b: str) -> dict:
    """phase, batch, seq, past (bench.decoder's fields), length (the shape's S or P) and the runtimes."""
    from .decoder import _shape_row

    return dict(_shape_row(phase, batch, n), length=n, a=a, b=b)


def compare_decoder(a, b, m, phase: str, batch: int, n: int, clock, rounds: int, iters: int, warmup: int) -> dict:
    """Time two started bench.decoder runtimes on one shape of decoder.Model `m` (prefill: S = n, no past;
    decode: one token over P = n positions) in alternating rounds. What one of them cannot run is the row's
    status and error, not an exception."""
    from .decoder import _too_long
    from .harness import _short

    row = _decoder_row(phase, batch, n, a.name, b.name)
    reason = _too_long(m, phase, n)
    if reason:
        return dict(row, status="skipped", error=reason)
    feeds = m.feeds(phase, batch, n)
    runs = []
    for side, rt in (("A", a), ("B", b)):
        try:
            run = rt.runner(m, feeds)
            for _ in range(warmup):
                run()
        except Exception as e:  # noqa: BLE001  (a shape a runtime cannot run is a row)
            return dict(row, status="error", error=f"{side} ({rt.name}) cannot run {phase} {batch}x{n}: {_short(e)}")
        runs.append(run)
    try:
        medians = alternate(runs, clock, rounds, iters)
        logits = [run.logits()[:, -1].astype("float32") for run in runs]
    except Exception as e:  # noqa: BLE001
        return dict(row, status="error", error=_short(e))
    diff = float(abs(logits[1] - logits[0]).max())
    return dict(row, status="ok", **_result(medians, rounds, iters), max_abs_diff_b_vs_a=diff)


def bench_decoder(model: str, a: str, b: str, prefill, decode, *, dtype="float16", device="cuda", rounds=10,
                  iters=30, warmup=10, work=None, log=print, save=None) -> tuple[list[dict], dict]:
    """Runtimes `a` and `b` (names in bench.decoder.ALL; the same name twice: the A/A noise) on decoder
    `model`, every prefill (B, S) then every decode (B, P) shape. Returns the rows and {"a": .., "b": ..},
    each runtime's fusion info or why it could not run. save(rows) is called after every row."""
    from . import decoder
    from .harness import Clock, _release, _short

    shapes = [("prefill", bs, n) for bs, n in prefill] + [("decode", bs, n) for bs, n in decode]
    rows, info = [], {}
    with tempfile.TemporaryDirectory(prefix="ort_triton_ab_") as tmp:
        if work:
            pathlib.Path(work).mkdir(parents=True, exist_ok=True)
        m = decoder.Model(model, dtype, device, pathlib.Path(work or tmp))
        rts = {"a": decoder.runtime(a), "b": decoder.runtime(b)}
        failed = None
        for rt in rts.values():  # both, before either starts (an export and a fusion)
            reason = rt.available(m)
            if reason:
                failed = dict(status="skipped", error=f"{rt.name} cannot run here: {reason}")
                break
        started = []  # stopped on every way out: a B that fails to start must not leave A's sessions behind
        try:
            for side, rt in rts.items():
                if failed:
                    break
                try:
                    rt.start(m)
                except Exception as e:  # noqa: BLE001
                    failed = dict(status="error", error=f"{rt.name} failed to start: {_short(e)}")
                    break
                started.append(rt)
                info[side] = rt.info
            if failed:
                info["error"] = failed["error"]
                rows = [dict(_decoder_row(p, bs, n, a, b), **failed) for p, bs, n in shapes]
                if save:
                    save(rows)
                return rows, info
            clock = Clock(device)
            log(f"{model} {dtype} ({m.params / 1e6:.1f} M parameters) on {device}: B={b} against A={a}, "
                f"{rounds} alternating rounds of {iters} calls each")
            for phase, bs, n in shapes:
                row = compare_decoder(rts["a"], rts["b"], m, phase, bs, n, clock, rounds, iters, warmup)
                rows.append(row)
                _release(device)
                label = f"{phase:7} {bs}x{n:<6}"
                if row["status"] == "ok":
                    log(f"{label} A {row['a_ms']:8.3f} ms  B {row['b_ms']:8.3f} ms  B/A speedup "
                        f"{row['speedup']:.3f}x (rounds {row['ratio_min']:.3f}-{row['ratio_max']:.3f}), "
                        f"|B-A| {row['max_abs_diff_b_vs_a']:.2e}")
                else:
                    log(f"{label} {row['status']}: {row['error']}")
                if save:
                    save(rows)
        finally:
            for rt in started:
                rt.stop()
            _release(device)
    return rows, info


def summary(rows: list[dict]) -> dict | None:
    """geomean, min and max of B's speedup over the rows that ran (None when none did)."""
    s = [r["speedup"] for r in rows if "speedup" in r]
    if not s:
        return None
    return dict(geomean=math.exp(sum(map(math.log, s)) / len(s)), min=min(s), max=max(s), rows=len(s))


def _write(path: str, out: dict) -> None:
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)


def _main_decoder(p: argparse.ArgumentParser, args, command: str) -> int:
    from .. import decoders
    from . import decoder
    from .harness import environment

    if args.hf_config or args.shapes:
        p.error("--hf-config and --shapes are for encoders; with --decoder give --prefill and --decode")
    if args.decoder not in decoders.CONFIGS:
        p.error(f"unknown decoder {args.decoder!r}; known: {', '.join(decoders.CONFIGS)}")
    for name in (args.a, args.b):
        try:
            decoder.runtime(name)
        except ValueError as e:
            p.error(f"--decoder: {e}")
    if args.dtype not in decoder.ELEM_BYTES:
        p.error(f"--dtype for decoders: one of {', '.join(decoder.ELEM_BYTES)}")
    prefill = decoder.parse(decoder.PREFILL if args.prefill is None else args.prefill)
    decode = decoder.parse(decoder.DECODE if args.decode is None else args.decode)
    if not prefill and not decode:
        p.error("no shapes: --prefill and --decode are both empty")
    gpu, versions = environment(args.device)

    def save(rows, info=None):  # after every row: a run cut short keeps what it measured
        if args.json:
            _write(args.json, dict(model=args.decoder, kind="decoder", dtype=args.dtype, gpu=gpu, versions=versions,
                                   summary=summary(rows), rows=rows, runtimes=info, command=command))

    rows, info = bench_decoder(args.decoder, args.a, args.b, prefill, decode, dtype=args.dtype, device=args.device,
                               rounds=args.rounds, iters=args.iters, warmup=args.warmup, work=args.work,
                               log=lambda line: print(line, flush=True), save=save)
    save(rows, info)
    if "error" in info:
        print(f"error: {info['error']}", file=sys.stderr)
        return 2
    total = summary(rows)
    if not total:
        print("error: no shape ran", file=sys.stderr)
        return 1
    print(f"speedup geomean {total['geomean']:.3f}x, min {total['min']:.3f}x, max {total['max']:.3f}x "
          f"over {total['rows']} of {len(rows)} shapes")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-config", help="the encoder (default bert-base)")
    p.add_argument("--decoder", metavar="MODEL", help="a decoder instead (ort_triton.decoders.CONFIGS, e.g. "
                   "llama-1b): bench.decoder's runtimes, prefill and decode shapes")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--a", default="ort_triton_cuda_graph", help="the baseline runtime")
    p.add_argument("--b", default="ort_triton_tuned_cuda_graph", help="the runtime whose speedup over A is wanted")
    p.add_argument("--shapes", help=f"encoder BxS,... (default {SHAPES})")
    p.add_argument("--prefill", help="--decoder: prompt shapes BxS,... ('' for none; default bench.decoder's)")
    p.add_argument("--decode", help="--decoder: BxP,... one token over a cache of P ('' for none; default "
                   "bench.decoder's)")
    p.add_argument("--work", help="--decoder: keep the export and the fused models here and reuse them next time")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=30, help="timed calls per runtime and round")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", help="write the rows and the summary here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        p.error("need --rounds >= 1, --iters >= 1, --warmup >= 0")
    command = " ".join(["python -m ort_triton.bench.ab", *(argv if argv is not None else sys.argv[1:])])
    if args.decoder:
        return _main_decoder(p, args, command)
    if args.prefill is not None or args.decode is not None or args.work:
        p.error("--prefill, --decode and --work go with --decoder")

    from .harness import Clock, _graph_inputs, _vocab_size, environment, load_model, parse_shapes, random_inputs
    from .runtimes import RUNTIMES

    for name in (args.a, args.b):
        if name not in RUNTIMES:
            p.error(f"unknown runtime {name!r}; known: {', '.join(RUNTIMES)}")
    hf_config = args.hf_config or "bert-base"
    shapes = parse_shapes(args.shapes or SHAPES)
    a, b = RUNTIMES[args.a](), RUNTIMES[args.b]()
    gpu, versions = environment(args.device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ort_triton_ab_") as work:
        model = load_model(None, hf_config, args.dtype, args.device, "dynamo", pathlib.Path(work), shapes)
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
        _write(args.json, dict(model=hf_config, dtype=args.dtype, gpu=gpu, versions=versions, summary=total,
                               rows=rows, command=command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
