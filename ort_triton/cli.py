"""ort-triton: optimize | compare | bench | build | doctor | demo.

Exit codes: 0 success, 1 a check failed (accuracy FAILED), 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import re
import sys
import tempfile

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .runtime import past_proto_limit


class UserError(Exception):
    """Bad input: printed without a traceback, exit code 2."""


def _console(args) -> Console:
    # piped output (CI logs, `| tee`) gets 160 columns instead of rich's 80, so tables don't fold
    width = None if sys.stdout.isatty() else 160
    return Console(stderr=False, quiet=getattr(args, "quiet", False), highlight=False, width=width)


# ---- optimize -----------------------------------------------------------------------------------
def _external_files(model) -> set[str]:
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    return {ExternalDataInfo(t).location for t in _get_all_tensors(model) if uses_external_data(t)}


def _load_model(path: pathlib.Path):
    """(model with its external data loaded, the names of its external data files). The external files
    are checked first, so a missing one is named, not a traceback."""
    from onnx.external_data_helper import load_external_data_for_model

    model = _check_model(path)
    files = _external_files(model)
    load_external_data_for_model(model, str(path.parent))
    return model, files


def _check_model(path: pathlib.Path):
    """The model without its external data, after checking that the file parses and that every external
    data file it names exists (each a UserError that says so)."""
    import onnx

    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001  (protobuf raises DecodeError, onnx its own types)
        raise UserError(f"{path}: not a readable ONNX model ({type(e).__name__}: {str(e)[:200]})") from None
    missing = sorted(f for f in _external_files(model) if not (path.parent / f).is_file())
    if missing:
        raise UserError(f"{path}: its external data file(s) {', '.join(missing)} are missing; they must sit next "
                        f"to the model, in {path.parent}")
    return model


def _own_data_files(out: pathlib.Path) -> set[pathlib.Path]:
    """The data files an earlier save_atomic to `out` wrote and the model now at `out` still names: only
    those may be removed when it is replaced. A file `out` names under any other name is someone else's
    (`out` may be a copy of the input, naming the input's weights), and a file that is not an ONNX model
    names nothing."""
    import onnx

    if not out.is_file():
        return set()
    try:
        named = _external_files(onnx.load(str(out), load_external_data=False))
    except Exception:  # noqa: BLE001  (not a model: it is replaced whole, nothing else to clean up)
        return set()
    ours = re.compile(re.escape(out.name) + r"\.[0-9a-f]{8}\.data")
    return {out.parent / f for f in named if ours.fullmatch(f)}


def save_atomic(model, out: pathlib.Path, external: bool = False, keep=()) -> str | None:
    """Write next to the target, then rename: a crash leaves the old file or the new one, never half.
    With external=True, or past protobuf's 2 GiB, the weights go to a data file of a name unique to this
    write, which the new model references and which lands before it; the previous one (a data file an
    earlier save_atomic wrote for `out`) is removed after, unless it is in `keep` (the input's files).
    The model's tensors are moved out to the data file (the caller's model is consumed). Returns the data
    file's name, or None when everything went into `out`."""
    import uuid

    import onnx
    from onnx.external_data_helper import convert_model_to_external_data, write_external_data_tensors

    out.parent.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    kept = {pathlib.Path(os.path.realpath(k)) for k in keep}
    old_data = {f for f in _own_data_files(out) if pathlib.Path(os.path.realpath(f)) not in kept}
    data_name = None
    if external or past_proto_limit(model):
        data_name = f"{out.name}.{uuid.uuid4().hex[:8]}.data"
        convert_model_to_external_data(model, all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; the model gets the permissions of any new file
    try:
        if data_name:
            write_external_data_tensors(model, str(out.parent))  # a new name: nothing reads it yet
            if (out.parent / data_name).exists():
                os.chmod(out.parent / data_name, 0o666 & ~umask)
            else:  # every tensor was under the threshold
                data_name = None
        onnx.save(model, tmp)
        os.replace(tmp, out)
        for f in old_data - ({out.parent / data_name} if data_name else set()):
            f.unlink(missing_ok=True)
        return data_name
    except BaseException:
        if data_name:
            (out.parent / data_name).unlink(missing_ok=True)
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _model_mb(path: pathlib.Path, data_files) -> float:
    """The model's size on disk: the .onnx file and its external data files (names, next to it)."""
    return sum((path.parent / f).stat().st_size for f in {path.name, *data_files}) / 1e6


def _same_file(a: pathlib.Path, b: pathlib.Path) -> bool:
    return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))


def op_table(before, after, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("op")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for op in sorted(set(before) | set(after), key=lambda o: (-before.get(o, 0), o)):
        if before.get(op, 0) != after.get(op, 0):
            table.add_row(op, str(before.get(op, 0)), str(after.get(op, 0)))
    table.add_row("[bold]all nodes[/]", str(sum(before.values())), str(sum(after.values())))
    return table


def rule_table(report, verbose: bool) -> Table:
    table = Table(title="fusions", title_justify="left")
    for col, just in (("rule", "left"), ("matched / tried", "right"), ("does", "left")):
        table.add_column(col, justify=just)
    for st in report.rules.values():
        # escaped: identities and reasons hold brackets ("[Wq|Wk|Wv]", shapes) that rich would take for markup
        table.add_row(st.name, f"{st.matched} / {st.tried}", escape(st.identity))
        if verbose:
            for r in st.refused:
                table.add_row("", "[yellow]refused[/]", escape(f"{r.node}: {r.reason}"))
    return table


@contextlib.contextmanager
def _stage_progress(con: Console):
    """A progress bar over the rule stages, on a terminal only (logs get the tables, not bars)."""
    if not sys.stdout.isatty() or con.quiet:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=con, transient=True) as bar:
        task = bar.add_task("fusing", total=1)
        yield lambda done, total, what: bar.update(task, completed=done, total=total, description=what[:60])


def cmd_optimize(args) -> int:
    import graph_rewrites
    from graph_rewrites import static_shapes

    con = _console(args)
    # the rewriter probes shapes with ORT's SymbolicShapeInference, which logs a warning for each broadcast
    # it cannot prove ("unsupported broadcast between ..."); the rules report what they refuse and why, so
    # those lines only confuse (and -q promises nothing but errors)
    logging.getLogger("onnxruntime.tools.symbolic_shape_infer").setLevel(logging.ERROR)
    src, dst = pathlib.Path(args.input), pathlib.Path(args.output)
    if dst.exists() and _same_file(src, dst):
        raise UserError(f"output {dst} is the input: choose another path (the input is never overwritten)")
    if dst.is_dir():  # said before the rewrite, not after it at the rename
        raise UserError(f"output {dst} is a directory: give the file to write, e.g. -o {dst / (src.stem + '.ot.onnx')}")
    known = graph_rewrites.registry.BY_NAME
    if args.explain and args.explain not in known:
        raise UserError(f"--explain: unknown rule {args.explain!r}; rules: {', '.join(known)}")
    try:
        static = static_shapes.parse(args.static_shapes) if args.static_shapes else None
    except ValueError as e:
        raise UserError(str(e)) from None
    model, src_data = _load_model(src)
    src_files = [src.parent / f for f in src_data]
    if dst.exists() and any(_same_file(f, dst) for f in src_files):
        raise UserError(f"output {dst} is the input's external data file: choose another path (the input is never "
                        "overwritten)")
    try:
        keep = tuple(args.keep_fp32.split(",")) if args.keep_fp32 else graph_rewrites.FP32_KEEP
        with _stage_progress(con) as progress:
            out, report = graph_rewrites.optimize(model, only=args.only, disable=args.disable, enable=args.enable,
                                                  report=True,
                                                  float16=args.float16, keep_io_types=args.keep_io_types,
                                                  keep_fp32=keep, progress=progress, inplace=True,
                                                  static_shapes=static, kv_cache=args.kv_cache)
        del model  # consumed: its weights are in `out` now
    except ValueError as e:
        raise UserError(str(e)) from None
    # external data out where it came in; the input's data files are never removed, even when the old
    # output named them (a copy of the input)
    try:
        dst_data = save_atomic(out, dst, external=bool(src_data), keep=src_files)
    except OSError as e:  # a read-only or full disk: save_atomic has left the old output as it was
        raise UserError(f"cannot write {dst}: {e.strerror or e}") from None
    size = f"{_model_mb(src, src_data):.1f} MB -> {_model_mb(dst, [dst_data] if dst_data else []):.1f} MB"
    con.print(op_table(report.ops_before, report.ops_after, f"{src.name} -> {dst.name}  ({size})"))
    con.print(rule_table(report, args.verbose))
    if args.explain:
        st = report.rules[args.explain]
        con.print(f"[bold]{st.name}[/]: {escape(st.identity)}; matched {st.matched} of {st.tried} candidates")
        for r in st.refused:
            con.print(escape(f"  refused {r.node}: {r.reason}"))
        if st.best_partial:
            con.print(escape(f"  best partial match, at {st.best_partial.node}: {st.best_partial.reason}"))
        if not st.refused and not st.best_partial:
            con.print("  no node started this rule's pattern")
    for note in report.notes:
        con.print(f"[yellow]note:[/] {note}")
    if report.fused() == 0:
        con.print("nothing fused: the output is the input with no ort_triton ops (run with -v for why)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "input": str(src), "output": str(dst),
            "ops_before": dict(report.ops_before), "ops_after": dict(report.ops_after),
            "rules": {k: v.as_dict() for k, v in report.rules.items()}, "notes": report.notes,
        }, indent=2) + "\n")
    return 0


# ---- compare ------------------------------------------------------------------------------------
def _parse_inputs(text: str | None) -> tuple[dict | None, int, int, int | None]:
    """--inputs: an .npz of named arrays, or BATCHxSEQ[+PAST] for random inputs (default 2x16; a decoder's cache
    then holds PAST positions, SEQ when not given)."""
    if text and text.endswith(".npz"):
        import numpy as np

        path = pathlib.Path(text)
        if not path.is_file():
            raise UserError(f"{path}: no such file")
        with np.load(path) as data:
            return {k: data[k] for k in data.files}, 0, 0, None
    try:
        shape, _, past = (text or "2x16").lower().partition("+")
        batch, seq = (int(v) for v in shape.split("x"))
        past = int(past) if past else None
        if min(batch, seq, past or 0) < 0 or not batch or not seq:
            raise ValueError
    except ValueError:
        raise UserError(f"--inputs takes BATCHxSEQ or BATCHxSEQ+PAST (e.g. 2x16, or 2x1+64 for a decode step over 64 "
                        f"cached positions) or an .npz file, not {text!r}") from None
    return None, batch, seq, past


def cmd_compare(args) -> int:
    from .compare import compare_models

    con = _console(args)
    feeds, batch, seq, past = _parse_inputs(args.inputs)
    a, b = pathlib.Path(args.reference), pathlib.Path(args.candidate)
    for path in (a, b):  # a clear message for a missing or broken file; ORT then reads each path itself
        _check_model(path)
    try:
        diffs, used = compare_models(a, b, device=args.device, batch=batch, seq=seq, past=past, rtol=args.rtol,
                                     atol=args.atol, feeds=feeds)
    except Exception as e:  # noqa: BLE001  (ORT raises its own types for bad feeds, missing providers...)
        raise UserError(f"could not run the models: {type(e).__name__}: {str(e)[:400]}") from None
    table = Table(title=f"{args.candidate} vs {args.reference} ({args.device}; inputs "
                        f"{', '.join(f'{k} {list(v.shape)}' for k, v in used.items())})", title_justify="left")
    for col in ("output", "dtype", "shape", "max abs", "mean abs", "p99 abs", "rel", "result"):
        table.add_column(col)
    for d in diffs:
        table.add_row(d.name, d.dtype, "x".join(map(str, d.shape)), f"{d.max_abs:.3e}", f"{d.mean_abs:.3e}",
                      f"{d.p99_abs:.3e}", f"{d.rel:.3e}",
                      ("[green]PASSED[/]" if d.ok else "[red]FAILED[/]") + (f" ({d.note})" if d.note else ""))
    con.print(table)
    ok = all(d.ok for d in diffs)
    print(f"{'PASSED' if ok else 'FAILED'}: {sum(d.ok for d in diffs)}/{len(diffs)} outputs within "
          f"atol={args.atol:g} + rtol={args.rtol:g} * max|reference|")
    return 0 if ok else 1


# ---- build --------------------------------------------------------------------------------------
def cmd_build(args) -> int:
    from .aot.build import BuildError, build_library, parse_archs
    from .tuning import TuningError

    con = _console(args)
    try:
        lib = build_library(parse_archs(args.arch), args.output, jobs=args.jobs, ort_include=args.ort_include,
                            log=con.print, tuning_table=args.tuning)
    except (BuildError, TuningError) as e:
        raise UserError(str(e)) from None
    con.print(f"[green]built[/] {lib}")
    return 0


# ---- tune ---------------------------------------------------------------------------------------
def cmd_tune(args) -> int:
    from . import tune
    from .bench.harness import BenchError, parse_shapes

    con = _console(args)
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else []
        decode = parse_shapes(args.decode) if args.decode else []
    except BenchError as e:
        raise UserError(str(e)) from None
    if not shapes and not decode:
        raise UserError("give the shapes to tune for: --shapes BxS,... (and --decode BxP,... for a model with a "
                        "KV cache)")
    if args.budget_min <= 0:
        raise UserError("--budget-min must be positive")
    if args.compile_workers is not None and args.compile_workers < 0:
        raise UserError("--compile-workers must be 0 or more")
    _check_model(pathlib.Path(args.model))
    try:
        ops = tuple(o.strip() for o in args.ops.split(",") if o.strip()) if args.ops else None
        out = tune.tune(args.model, shapes, decode=decode, out=args.output, budget_min=args.budget_min, ops=ops,
                        workers=args.compile_workers, log=con.print)
    except ValueError as e:
        raise UserError(str(e)) from None
    con.print(f"next: ort-triton build --arch {tune.tuning.load(out)[0]['arch']} --tuning {out}")
    return 0


# ---- doctor -------------------------------------------------------------------------------------
def cmd_doctor(args) -> int:
    from . import doctor

    problems = doctor.report(_console(args))
    return 1 if problems else 0


# ---- demo: the main job on the embedded default model -------------------------------------------
def cmd_demo(args) -> int:
    from . import demo

    return demo.run(_console(args), model_name=args.model, out_dir=args.out_dir, device=args.device)


# ---- bench: runtimes side by side on one model ----------------------------------------------------
def cmd_bench(args) -> int:
    import shlex

    from .bench import harness, report

    con = _console(args)
    # the command as it would be typed, for the rows (committed results say how they were made)
    argv = ([args.model] if args.model else []) + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k in ("shapes", "runtimes", "hf_config", "exporter", "opset", "dtype", "warmup", "iters", "out", "device")
        and v is not None]
    try:
        rows = harness.bench(args.model, hf_config=args.hf_config, shapes=harness.parse_shapes(args.shapes),
                             runtimes=args.runtimes.split(",") if args.runtimes else None, dtype=args.dtype,
                             exporter=args.exporter, opset=args.opset, warmup=args.warmup, iters=args.iters,
                             device=args.device, out_dir=args.out, log=lambda s: con.print(s, markup=False),
                             command=shlex.join(["ort-triton", "bench", *argv]))
    except harness.BenchError as e:
        raise UserError(str(e)) from None
    report.print_table(rows, con)
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def cmd_export_server(args) -> int:
    from .runtime import LibraryNotFound
    from .server_repo import export_server

    con = _console(args)
    _check_model(pathlib.Path(args.model))
    try:
        where = export_server(args.model, args.out, name=args.name, library=args.library, server_repo=args.server_repo,
                              max_batch_size=args.max_batch_size, cuda_graph=args.cuda_graph,
                              instances=args.instances, force=args.force)
    except (ValueError, FileExistsError, FileNotFoundError, LibraryNotFound) as e:
        raise UserError(str(e)) from None
    con.print(f"wrote {where}: config.pbtxt, 1/model.onnx, libort_triton.so")
    con.print(f"serve: tritonserver --model-repository={args.server_repo or pathlib.Path(args.out).resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ort-triton", description=__doc__.splitlines()[0])
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    sub = p.add_subparsers(dest="cmd", required=True)

    o = sub.add_parser("optimize", help="fuse transformer subgraphs into ai.ort_triton ops")
    o.add_argument("input")
    o.add_argument("-o", "--output", required=True)
    o.add_argument("--only", action="append", metavar="RULE", help="apply only this rule (repeatable)")
    o.add_argument("--disable", action="append", metavar="RULE", help="skip this rule (repeatable)")
    o.add_argument("--enable", action="append", metavar="RULE", help="also apply this rule of those off by "
                   "default, not yet timed on a GPU or measured slower (repeatable; today: linear, "
                   "add_rms_norm_linear, add_rms_norm_swiglu)")
    o.add_argument("--float16", action="store_true", help="convert to fp16 after fusing (onnxruntime's converter)")
    o.add_argument("--keep-io-types", action="store_true", help="with --float16: graph inputs/outputs stay fp32")
    o.add_argument("--keep-fp32", metavar="OP,OP", help="with --float16: ops left in fp32 (default: "
                   "Pow, ReduceMean, ReduceSum, Exp, Log, Sqrt, ... and onnxruntime's block list)")
    o.add_argument("--static-shapes", metavar="NAME=DIMS,...", help="specialise for fixed input shapes, e.g. "
                   "input_ids=1x128,attention_mask=1x128: every shape computation folded, so ORT's CUDA EP runs "
                   "every node and can capture CUDA graphs")
    o.add_argument("--kv-cache", choices=("heads-first", "seq-major"), default="heads-first",
                   help="the fused decoder's cache layout: heads-first, the export's [B, Nkv, T, D] (default), or "
                   "seq-major, [T, B, Nkv, D], where a caller binds each present over its past and no decode step "
                   "copies the cache (the model's cache inputs and outputs change with it)")
    o.add_argument("-v", "--verbose", action="store_true", help="show every refused candidate and why")
    o.add_argument("--explain", metavar="RULE", help="for one rule: every refusal and its best partial match")
    o.add_argument("--json", metavar="PATH", help="write the report as JSON")
    o.set_defaults(func=cmd_optimize)

    c = sub.add_parser("compare", help="run two models on the same inputs; PASSED/FAILED per output")
    c.add_argument("reference")
    c.add_argument("candidate")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    c.add_argument("--rtol", type=float, default=1e-4, help="relative to the output's largest magnitude")
    c.add_argument("--atol", type=float, default=0.0)
    c.add_argument("--inputs", help="BATCHxSEQ[+PAST] for random inputs (default 2x16; a decoder's KV cache holds PAST "
                   "positions, SEQ when not given), or an .npz of named arrays")
    c.set_defaults(func=cmd_compare)

    b = sub.add_parser("build", help="compile the kernels and the native library (no GPU needed)")
    b.add_argument("--arch", help="compute capabilities, e.g. 80,86,89,90 (default)")
    b.add_argument("-o", "--output", help="directory for libort_triton.so")
    b.add_argument("-j", "--jobs", type=int, help="parallel compiles (default: all cores)")
    b.add_argument("--ort-include", help="directory with onnxruntime_c_api.h (default: fetched)")
    b.add_argument("--tuning", metavar="TABLE", help="a table from `ort-triton tune`: its configs are compiled "
                   "ahead of the built-in ones, for the GPU arch each was tuned on")
    b.set_defaults(func=cmd_build)

    t = sub.add_parser("tune", help="time kernel configurations for a fused model's shapes on this GPU and write "
                       "a tuning table for build --tuning")
    t.add_argument("model", help="a model from ort-triton optimize")
    t.add_argument("--shapes", help="BATCHxSEQ,... (for a model with a KV cache: prompts, no past)")
    t.add_argument("--decode", help="BATCHxPAST,...: one new token over a cache of PAST positions (KV-cache models)")
    t.add_argument("--budget-min", type=float, default=10.0, help="time budget in minutes (default 10): problems "
                   "not reached keep the built-in configs")
    t.add_argument("--ops", help="comma-separated op names to tune (default: every tunable op in the model)")
    t.add_argument("--compile-workers", type=int, metavar="N", help="processes that compile the candidate "
                   "configs ahead of the timing (default: one per CPU core; 0 or 1: each compiles when first timed)")
    t.add_argument("-o", "--output", help="the table (default: MODEL.tuning.json beside the model)")
    t.set_defaults(func=cmd_tune)

    d = sub.add_parser("doctor", help="check ORT, GPU, library and Triton, and say how to fix what is missing")
    d.set_defaults(func=cmd_doctor)

    m = sub.add_parser("demo", help="build a BERT from a config, export it both ways, optimize, check outputs")
    m.add_argument("--model", default="bert-tiny")
    m.add_argument("--out-dir", help="keep the exported and optimized models here")
    m.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    m.set_defaults(func=cmd_demo)

    from .bench.runtimes import DEFAULT_RUNTIMES, RUNTIMES

    n = sub.add_parser("bench", help="time one model on ORT, ORT + ort_triton, torch, ... (same inputs, one process)")
    n.add_argument("model", nargs="?", help="the ONNX model (optional with --hf-config)")
    n.add_argument("--shapes", default="1x128,8x128,8x512", help="BATCHxSEQ,... (default %(default)s)")
    n.add_argument("--runtimes", help=f"comma-separated from {','.join(RUNTIMES)}; default all but the tuned "
                   f"library's (ORT_TRITON_TUNED_LIBRARY): {','.join(DEFAULT_RUNTIMES)}")
    n.add_argument("--hf-config", help="build this model from ort_triton.models.CONFIGS (e.g. bert-base), export it, "
                   "and add the torch runtimes")
    n.add_argument("--exporter", choices=("dynamo", "torchscript"), default="dynamo", help="with --hf-config")
    n.add_argument("--opset", type=int, help="with --hf-config (default: the exporter's)")
    n.add_argument("--dtype", choices=("float16", "float32"),
                   help="with --hf-config (default float16 on cuda, float32 on cpu); a file runs in its own")
    n.add_argument("--warmup", type=int, default=20, help="untimed runs per shape and runtime")
    n.add_argument("--iters", type=int, default=200, help="timed runs per shape and runtime")
    n.add_argument("--out", default="bench-results", help="directory for the JSON, CSV, PNG and the table (.md)")
    n.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    n.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS)
    n.set_defaults(func=cmd_bench)

    x = sub.add_parser("export-server", help="write a Triton Inference Server model repository (ONNX Runtime backend)")
    x.add_argument("model", help="the optimized ONNX model")
    x.add_argument("--out", required=True, help="the model repository directory")
    x.add_argument("--name", help="model name (default: the file's stem)")
    x.add_argument("--library", help="libort_triton.so to ship (default: the one ort_triton finds)")
    x.add_argument("--server-repo", help="where the repository sits on the server, e.g. /models (the config names "
                   "the library by absolute path; default: --out as written)")
    x.add_argument("--max-batch-size", type=int, default=8, help="dynamic batching up to this (0: unbatched)")
    x.add_argument("--cuda-graph", action="store_true", help="CUDA EP enable_cuda_graph (needs a static-shape "
                   "model: optimize --static-shapes); served unbatched")
    x.add_argument("--instances", type=int, default=1, help="model instances per GPU")
    x.add_argument("--force", action="store_true", help="replace REPO/NAME if it exists")
    x.set_defaults(func=cmd_export_server)

    for sp in (o, c, b, d, m, x):
        sp.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"ort-triton {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
