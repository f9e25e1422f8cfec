"""`ort-triton tune MODEL.onnx --shapes 1x128,8x512 [--decode 1x1024] [--budget-min N]`: pick kernel
configurations per shape bucket on this GPU and write a tuning table for `ort-triton build --tuning`.

    fused model + shapes -> the fused nodes' input shapes (one ORT run per shape, the nodes' inputs
    exposed as outputs) -> problems (op, type, dispatch keys; one per bucket) -> time each op's candidate
    configs (its contract's `tuning`: the built-in config first) with the Triton kernel -> the table

Timing: triton.testing.do_bench_cudagraph (median of many replays after warm-up) on the GPU, in two rounds: every
candidate is screened with short replays (SCREEN_REP_MS), then the built-in config and the FINALISTS fastest
are timed again with long ones (REP_MS), and only those long timings decide. A candidate replaces the
built-in config only when it is faster by more than NOISE: a second run on an idle GPU then picks the same
configs (within noise), and a tuned library is never slower than the built-in one by the tuner's own
measure. A config that fails to compile or to launch (out of shared memory or registers) is skipped and
listed with the reason. The budget is checked before each first-round timing: problems it does not reach
keep the built-in configs and are listed as not tuned. A problem's final (at most FINALISTS + 1 long timings,
~3 s on the GPU) runs once its screen is done, so the budget can overrun by one final.

Compiling: on the GPU every candidate is compiled ahead, by a pool of spawned workers that warm Triton's disk
cache (ort_triton/tune_compile.py), so the budget goes to timing rather than to serial JIT compiles. That
phase counts against the budget and stops submitting once COMPILE_SHARE of it is spent; what it did not
reach compiles in the timing loop, as before. A config that failed in a worker is skipped there with the
worker's reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time

import numpy as np

from . import ops as ops_mod
from . import tune_compile, tuning
from .contract import ELEMENT_TYPES

NOISE = 0.03  # a candidate must beat the built-in config by 3% (run-to-run noise of do_bench on an idle GPU)
# The compile phase stops submitting once this share of the budget left is spent, so what it compiled can still
# be timed: the budget-bound case is a 1B model whose few hundred candidates take longer to compile than the
# budget even over 16 cores. A guess, not a measurement (a timing is ~0.5 s of CUDA-graph replays, a compile
# a few seconds of one core); more rather than less, since a config compiled and never timed costs a worker
# part of a second, and one left out costs the timing loop a serial compile of seconds.
COMPILE_SHARE = 0.5
# Screening then a final: a long timing is ~0.5 s (do_bench_cudagraph replays REP_MS ten times, plus the
# capture), which at ~24 candidates a problem made timing, not compiling, the limit of a 1B model's tune
# (session 7: 10 of 26 problems in 1.5 min). A short one sorts the candidates well enough to pick finalists:
# the near-ties it may misorder are what the final's long timings settle.
REP_MS, SCREEN_REP_MS = 40, 5
FINALISTS = 4


@dataclasses.dataclass
class Problem:
    op: str
    type: str
    keys: tuple[int, ...]
    bucket: tuple[tuple[int, int], ...]
    shapes: list  # the node's input shapes at the first model shape that reached this bucket
    attrs: dict
    nodes: int = 0  # fused nodes in the model that meet it
    seen_at: list = dataclasses.field(default_factory=list)  # the model shapes that reach it


_TYPES = {code: name for name, code in ELEMENT_TYPES.items()}  # ONNX element type -> contract type name
_NUMPY_TYPES = {"float32": "float", "float16": "float16", "bfloat16": "bfloat16"}  # numpy dtype -> the same


def _input_specs(proto):
    inits = {t.name for t in proto.graph.initializer}
    return [(vi.name, vi.type.tensor_type.elem_type, [d.dim_value if d.HasField("dim_value") else None
                                                      for d in vi.type.tensor_type.shape.dim])
            for vi in proto.graph.input if vi.name not in inits]


def model_feeds(proto, batch: int, seq: int, past: int = 0, seed: int = 0) -> dict:
    """Random inputs for one model shape. A model with a KV cache (inputs named past_*): S new tokens over
    P cached positions (past_* [B, ..., P, D], attention_mask [B, P + S]); otherwise every symbolic dim is
    B when first and S after. Token ids stay below the table they index."""
    from .compare import index_ranges, random_normal

    rng = np.random.default_rng(seed)
    ranges = index_ranges(proto)
    cache = any(name.startswith("past") for name, _, _ in _input_specs(proto))
    feeds = {}
    for name, elem, dims in _input_specs(proto):
        if cache and name.startswith("past"):
            shape = [batch if i == 0 else (past if i == len(dims) - 2 else d) for i, d in enumerate(dims)]
        elif cache and "mask" in name:
            shape = [batch, past + seq]
        else:
            shape = [d if d is not None else (batch if i == 0 else seq) for i, d in enumerate(dims)]
        if any(d is None for d in shape):
            raise ValueError(f"input {name} has a dim this shape does not fix: {dims}")
        if elem in _TYPES:
            feeds[name] = random_normal(rng, shape, f"tensor({_TYPES[elem]})")
        elif "mask" in name:
            feeds[name] = np.ones(shape, np.int64)
        else:
            feeds[name] = rng.integers(0, ranges.get(name, 2), shape, dtype=np.int64)
    return feeds


def _attrs(node, contract) -> dict:
    from onnx import helper

    given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {a.name: given.get(a.name, a.default) for a in contract.attrs}


def find_problems(model_path, shapes, *, decode=(), device: str = "cuda", library=None, ops=None,
                  log=print) -> list[Problem]:
    """The tunable nodes of a fused model (of `ops` only, when given) and their input shapes at each model
    shape: one run per shape with those nodes' inputs added as outputs (ORT CUDA with the library, or ORT CPU
    through the function bodies), grouped into problems by (op, type, bucket)."""
    import onnx
    import onnxruntime as ort

    from .compare import run_session
    from .contract import DOMAIN

    model_path = pathlib.Path(model_path)
    proto = onnx.load(str(model_path), load_external_data=False)  # a 1B model's weights stay on disk
    tunable = {op.name: op for op in ops_mod.ALL_OPS if op.tuning}
    if ops is not None:
        unknown = sorted(set(ops) - set(tunable))
        if unknown:
            raise ValueError(f"not tunable: {', '.join(unknown)}; the tunable ops are {', '.join(sorted(tunable))}")
        tunable = {name: op for name, op in tunable.items() if name in ops}
    nodes = [n for n in proto.graph.node if n.domain == DOMAIN and n.op_type in tunable]
    if not nodes:
        ours = sorted({n.op_type for n in proto.graph.node if n.domain == DOMAIN})
        raise ValueError(f"{model_path} has no tunable node ({', '.join(sorted(tunable))}); "
                         + ("it has " + ", ".join(ours) if ours else "run `ort-triton optimize` on it first"))
    outputs = {o.name for o in proto.graph.output}
    wanted = list(dict.fromkeys(i for n in nodes for i in n.input if i and i not in outputs))
    proto.graph.output.extend(onnx.ValueInfoProto(name=name) for name in wanted)
    # the probe sits beside the model, so its external data paths resolve; removed when the session is made
    probe = model_path.with_name(f".{model_path.stem}.tune-probe.{os.getpid()}.onnx")
    try:
        onnx.save(proto, str(probe))
        if device == "cuda":
            from .runtime import make_session

            sess = make_session(probe, providers=["CUDAExecutionProvider"], library=library)
        else:
            sess = ort.InferenceSession(str(probe), providers=["CPUExecutionProvider"])
    finally:
        probe.unlink(missing_ok=True)
    names = [o.name for o in sess.get_outputs()]
    inits = {t.name: list(t.dims) for t in proto.graph.initializer}
    problems: dict[tuple, Problem] = {}
    runs = [("prefill" if decode else "shape", b, s, 0) for b, s in shapes] + [("decode", b, 1, p) for b, p in decode]
    for kind, b, s, past in runs:
        label = f"{kind} {b}x{past if kind == 'decode' else s}"
        feeds = model_feeds(proto, b, s, past)
        values = dict(zip(names, run_session(sess, feeds))) | feeds  # bfloat16 too (compare.run_session)
        for n in nodes:
            contract = tunable[n.op_type]
            shapes_in = [list(values[i].shape) if i in values else inits.get(i) for i in n.input]
            type_name = _NUMPY_TYPES.get(str(values[n.input[0]].dtype))
            if type_name is None:
                raise ValueError(f"{n.op_type} node {n.name!r}: input {n.input[0]} is {values[n.input[0]].dtype}; "
                                 f"the kernels take {', '.join(ELEMENT_TYPES)}")
            attrs = _attrs(n, contract)
            n_outputs = max((i + 1 for i, o in enumerate(n.output) if o), default=0)  # as the library counts
            keys = contract.tuning.keys(type_name, shapes_in, attrs, n_outputs)
            if keys is None:  # no kernel of ours at these shapes (Linear past 16 rows runs cuBLAS)
                continue
            bucket = contract.tuning.bucket(keys)
            p = problems.setdefault((n.op_type, type_name, bucket),
                                    Problem(n.op_type, type_name, keys, bucket, shapes_in, attrs))
            p.nodes += 1
            if label not in p.seen_at:
                p.seen_at.append(label)
        log(f"  {label}: {len(nodes)} tunable node(s)")
    return list(problems.values())


def _gpu_timer(fn, rep: int = REP_MS) -> float:
    """Median ms of the kernel replayed in a CUDA graph: a decode-sized kernel runs for less time than
    Python takes to launch it, so plain do_bench would time the launch (as the library's kernels run in
    ORT's graphs, or back to back from C)."""
    import triton.testing

    fn()  # compile outside the capture
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def _gpu_screen(fn) -> float:
    return _gpu_timer(fn, SCREEN_REP_MS)


def _wall_timer(fn, runs: int = 3) -> float:
    """Median wall time in ms (the CPU path: Triton's interpreter; the numbers mean nothing, the flow does)."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def candidates_of(p: Problem, arch: int, max_candidates=None) -> list[dict]:
    """The configs timed for a problem, the built-in one first: the compile phase and the timing loop both
    take them from here, so they agree on what candidate i is."""
    return ops_mod.BY_NAME[p.op].tuning.candidates(p.type, p.keys, arch)[:max_candidates]


def compile_phase(problems: list[Problem], arch: int, device: str, deadline: float, workers: int,
                  max_candidates=None, *, compiler=None, log=print) -> tuple[list[dict], float]:
    """Compile every problem's candidates ahead (on the GPU, with more than one worker; the CPU path runs
    Triton's interpreter, which compiles nothing). Returns per problem {candidate index: why it failed to
    compile or launch} and the seconds spent. compiler(jobs, workers, deadline) -> tune_compile.Ahead:
    tune_compile.compile_ahead unless given (tests pass a fake one); its deadline is COMPILE_SHARE of the
    budget left."""
    failed = [{} for _ in problems]
    if device != "cuda" or workers <= 1:
        return failed, 0.0
    now = time.monotonic()
    compile_deadline = now + COMPILE_SHARE * (deadline - now)
    jobs = [tune_compile.Job(pi, ci, p.op, p.type, p.shapes, p.attrs, p.keys, cfg, device)
            for pi, p in enumerate(problems) for ci, cfg in enumerate(candidates_of(p, arch, max_candidates))]
    ahead = (compiler or tune_compile.compile_ahead)(jobs, workers, compile_deadline)
    for (pi, ci), reason in ahead.failed.items():
        failed[pi][ci] = reason
    left = len(jobs) - ahead.submitted
    log(f"compiled {ahead.compiled} of {len(jobs)} config(s) ahead in {ahead.seconds:.1f} s with "
        f"{ahead.workers} worker(s), {len(ahead.failed)} failed"
        + (f"; {left} left to compile in the timing loop ({ahead.broken or 'budget'})" if left else ""))
    return failed, ahead.seconds


def tune_problem(p: Problem, arch: int, device: str, deadline: float, timer, max_candidates=None,
                 failed=None, screen=None) -> dict:
    """Time the built-in config and the candidates (until the deadline); the entry for the table. failed:
    {candidate index: reason} from the compile phase, skipped without a retry (but for the built-in config,
    which is retried: its failure is an error, raised with the parent's own traceback). screen: a shorter
    timer for a first round over every candidate, after which `timer` times the built-in config and the
    FINALISTS fastest again and decides (None: `timer` times every candidate once)."""
    candidates = candidates_of(p, arch, max_candidates)
    contract = ops_mod.BY_NAME[p.op]
    failed = failed or {}
    builtin = candidates[0]

    def runner(cfg):
        return contract.tuning.runner(p.type, p.shapes, p.attrs, p.keys, cfg, device)

    first, skipped = [], []  # first: (ms, candidate index) of the first round
    for i, cfg in enumerate(candidates):
        if i and time.monotonic() > deadline:
            skipped.append(dict(config=cfg, reason="budget"))
            continue
        if i and i in failed:
            skipped.append(dict(config=cfg, reason=failed[i]))
            continue
        try:
            first.append(((screen or timer)(runner(cfg)), i))
        except Exception as e:  # noqa: BLE001  (a config that cannot compile or launch is skipped, said why)
            if i == 0:
                raise RuntimeError(f"{p.op} {p.type}: the built-in config {cfg} failed: {_short(e)}") from e
            skipped.append(dict(config=cfg, reason=_short(e)))
    final = first
    if screen is not None:
        ahead = sorted(t for t in first if t[1])[:FINALISTS]
        final = [(timer(runner(candidates[i])), i) for _, i in [first[0], *ahead]]
    builtin_ms = final[0][0]
    best_ms, best_i = min(final)
    keep = best_i == 0 or best_ms > builtin_ms * (1 - NOISE)
    return dict(op=p.op, type=p.type, arch=arch, keys=[list(r) for r in p.bucket],
                config=builtin if keep else candidates[best_i], builtin=keep,
                ms=builtin_ms if keep else best_ms, builtin_ms=builtin_ms,
                problem=dict(shapes=p.shapes, attrs=p.attrs, keys=list(p.keys), nodes=p.nodes, seen_at=p.seen_at),
                timed=len(first), finalists=len(final) if screen is not None else 0, skipped=skipped)


def tune(model_path, shapes, *, decode=(), out=None, budget_min: float = 10.0, device: str = "cuda",
         arch: int | None = None, library=None, timer=None, screen=None, max_candidates=None, ops=None,
         workers: int | None = None, compiler=None, log=print) -> pathlib.Path:
    """Tune every tunable fused node of the model at the given shapes; writes the table (default: next to
    the model, MODEL.tuning.json) and returns its path. workers: processes that compile the candidates ahead
    (default: one per CPU core; 0 or 1 compiles each in the timing loop); compiler: see compile_phase;
    timer, screen: see tune_problem (defaults: on the GPU the long and the short CUDA-graph timers; on the CPU
    the wall timer and no screening)."""
    import triton

    t0 = time.monotonic()
    model_path = pathlib.Path(model_path)
    gpu = None
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("tuning times kernels on a GPU and torch sees none; run it on the GPU the model "
                             "will serve on")
        major, minor = torch.cuda.get_device_capability()
        arch, gpu = arch or 10 * major + minor, torch.cuda.get_device_name()
    elif arch is None:
        raise ValueError("device cpu (Triton's interpreter, for tests) needs the arch to label the table with")
    if timer is None:
        timer = _gpu_timer if device == "cuda" else _wall_timer
        screen = screen or (_gpu_screen if device == "cuda" else None)
    log(f"tune {model_path.name} on {gpu or 'cpu (interpreter)'} (sm_{arch}), budget {budget_min:g} min")
    problems = find_problems(model_path, shapes, decode=decode, device=device, library=library, ops=ops, log=log)
    deadline = t0 + budget_min * 60
    workers = (os.cpu_count() or 1) if workers is None else workers
    failed, compile_s = compile_phase(problems, arch, device, deadline, workers, max_candidates,
                                      compiler=compiler, log=log)
    entries = []
    for i, p in enumerate(problems, 1):
        if time.monotonic() > deadline:
            log(f"[{i}/{len(problems)}] {p.op} {p.type} keys {p.keys}: not tuned (budget spent): built-in kept")
            continue
        e = tune_problem(p, arch, device, deadline, timer, max_candidates, failed[i - 1], screen)
        entries.append(e)
        verdict = ("built-in kept" if e["builtin"] else
                   f"{e['builtin_ms'] / e['ms']:.2f}x with {json.dumps(e['config'])}")
        log(f"[{i}/{len(problems)}] {p.op} {p.type} keys {p.keys} ({', '.join(p.seen_at)}): built-in "
            f"{e['builtin_ms']:.4f} ms, {e['timed']} timed"
            + (f" ({e['finalists']} again)" if e["finalists"] else "") + f", {len(e['skipped'])} skipped: {verdict}")
    out = pathlib.Path(out) if out else model_path.with_name(model_path.stem + ".tuning.json")
    header = dict(gpu=gpu, arch=arch, triton=triton.__version__, model=str(model_path),
                  shapes=[f"{b}x{s}" for b, s in shapes], decode=[f"{b}x{p}" for b, p in decode],
                  budget_min=budget_min, elapsed_s=round(time.monotonic() - t0, 1), compile_s=round(compile_s, 1),
                  problems=len(problems), not_tuned=len(problems) - len(entries), command=" ".join(sys.argv))
    tuning.save(out, header, entries)
    tuned = sum(not e["builtin"] for e in entries)
    log(f"wrote {out}: {len(entries)} of {len(problems)} problem(s) timed, {tuned} with a faster config")
    return out
