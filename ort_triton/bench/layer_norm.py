"""LayerNorm bandwidth on the GPU: our kernel inside ORT against ORT's own LayerNormalization and
SkipLayerNormalization kernels, same process, same inputs.

    python -m ort_triton.bench.layer_norm --library build/lib/libort_triton.so --json OUT.json
    ... --library build/lib/libort_triton.so --library alt=build/alt/libort_triton.so   # candidates side by side

Each model is a chain of K identical nodes (y <- op(y[, r])), run on the CUDA EP with IO binding and
ORT's CUDA graph, so the per-node time is the kernel's, not ORT's host overhead; with the sum written,
the chain is a pre-LN residual stream (y, s <- op(y, s)): every sum is read by the next node, so ORT's
arena reuses its buffers and 65536 x 8192 fits many sessions at once. Timed with CUDA events over
interleaved rounds (every session of a shape in each round). Each variant runs in --instances sessions of
its own: one session's buffers land where they land, and identical kernels in two sessions differ by up
to 6% at 65536 rows (session 10), so a variant's time is the median over its sessions of each one's
median, and the spread over them is reported with it.
Bytes per node: LayerNorm reads X and writes Y (2 tensors),
with a residual it also reads the skip (3), and writes the sum when asked (4); gamma/beta are noise.
The ceiling is the measured device-to-device copy bandwidth (FACTS.md: 4.08 TB/s, read + write).
The Triton kernel alone (no ORT; its launches in a CUDA graph, triton.testing.do_bench_cudagraph) is
reported beside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..contract import DOMAIN, DOMAIN_VERSION
from ..ops import ADD_LAYER_NORM, LAYER_NORM

CEILING_GBS = 4080.0
K = 16  # nodes per chain
ONNX_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16, "float": TensorProto.FLOAT}

# runtime -> (op type, domain, tensors moved per node, has residual)
VARIANTS = {
    "ort_LayerNormalization": ("LayerNormalization", "", 2, False),
    "ort_triton_LayerNorm": ("LayerNorm", DOMAIN, 2, False),
    "ort_SkipLayerNormalization": ("SkipLayerNormalization", "com.microsoft", 3, True),
    "ort_triton_AddLayerNorm": ("AddLayerNorm", DOMAIN, 3, True),
    "ort_SkipLayerNormalization+sum": ("SkipLayerNormalization", "com.microsoft", 4, True),
    "ort_triton_AddLayerNorm+sum": ("AddLayerNorm", DOMAIN, 4, True),
}


def chain_model(variant: str, hidden: int, type_name: str) -> onnx.ModelProto:
    op, domain, _moved, residual = VARIANTS[variant]
    t = ONNX_TYPES[type_name]
    keep_sum = variant.endswith("+sum")
    nodes = []
    prev, prev_sum = "x", "r"
    for i in range(K):
        skip_ins = [prev, prev_sum, "c", "g", "b"] if domain == DOMAIN else [prev, prev_sum, "g", "b"]
        ins = skip_ins if residual else [prev, "g", "b"]
        outs = [f"y{i}"]
        if keep_sum:  # the residual stream: the next node reads this sum, so it must be written
            outs = [f"y{i}", f"s{i}"] if domain == DOMAIN else [f"y{i}", "", "", f"s{i}"]
            prev_sum = f"s{i}"
        elif domain == DOMAIN and residual:
            outs = [f"y{i}", ""]
        attrs = {"epsilon": 1e-5} if domain else {"axis": -1, "epsilon": 1e-5}
        nodes.append(helper.make_node(op, ins, outs, domain=domain, **attrs))
        prev = f"y{i}"
    outputs = [helper.make_tensor_value_info(name, t, None) for name in ([prev, prev_sum] if keep_sum else [prev])]
    inputs = [helper.make_tensor_value_info("x", t, ["n", hidden])]
    if residual:
        inputs.append(helper.make_tensor_value_info("r", t, ["n", hidden]))
    np_t = {"float16": np.float16, "float": np.float32}.get(type_name)
    g = np.random.default_rng(1).normal(1, 0.1, hidden)
    inits = [numpy_helper.from_array(g.astype(np_t), "g"), numpy_helper.from_array(np.zeros(hidden, np_t), "b"),
             numpy_helper.from_array(np.zeros(hidden, np_t), "c")]  # AddLayerNorm's bias (SkipLayerNorm has none)
    graph = helper.make_graph(nodes, variant, inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
              helper.make_opsetid(DOMAIN, DOMAIN_VERSION)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9,
                             functions=[LAYER_NORM.function_proto(17), ADD_LAYER_NORM.function_proto(17)])


def make_runner(model, feeds_torch: dict, library):
    """A CUDA-graph-captured session with IO binding on torch buffers; returns run() -> ms of one replay."""
    import onnxruntime as ort
    import torch

    so = ort.SessionOptions()
    if library:
        so.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    io = sess.io_binding()
    for name, t in feeds_torch.items():
        io.bind_input(name, "cuda", 0, _np_dtype(t), list(t.shape), t.data_ptr())
    for o in sess.get_outputs():
        io.bind_output(o.name, "cuda")
    ro = ort.RunOptions()
    for _ in range(5):  # the first run captures the graph
        sess.run_with_iobinding(io, ro)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run() -> float:
        start.record()
        sess.run_with_iobinding(io, ro)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    run.session = sess  # keeps the session (and its buffers) alive with the runner
    return run


def _np_dtype(t):
    import torch

    return {torch.float16: np.float16, torch.float32: np.float32}[t.dtype]


def triton_only(rows: int, hidden: int, variant: str, type_name: str) -> float:
    import torch
    import triton

    from ..kernels.layer_norm import layer_norm

    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32}[type_name]
    x = torch.randn(rows, hidden, device="cuda", dtype=dt)
    r = torch.randn_like(x)
    g, b, c = (torch.randn(hidden, device="cuda", dtype=dt) for _ in range(3))
    _op, _d, _moved, residual = VARIANTS[variant]
    fn = lambda: layer_norm(x, g, b, r if residual else None, store_sum=variant.endswith("+sum"),
                            bias=c if residual else None)
    fn()  # compile outside the graph capture
    return triton.testing.do_bench_cudagraph(fn, rep=300, return_mode="median")


PAIRS = (("LayerNorm", "ort_triton_LayerNorm", "ort_LayerNormalization"),
         ("AddLayerNorm", "ort_triton_AddLayerNorm", "ort_SkipLayerNormalization"),
         ("AddLayerNorm+sum", "ort_triton_AddLayerNorm+sum", "ort_SkipLayerNormalization+sum"))


def summary(report: dict) -> str:
    """A markdown table: per shape and op, our time, ORT's, the speedup, our fraction of the ceiling and
    the spread of each time over its sessions (files from before --instances have none: "-")."""
    by = {(r["type"], r["rows"], r["hidden"], r["variant"]): r for r in report["rows"]}
    pct = lambda r: f"{100 * r['spread']:.1f}%" if r.get("spread") is not None else "-"  # noqa: E731
    lines = [f"GPU: {report['gpu']}; copy in the same run {report.get('copy_gbs_this_run', float('nan')):.0f} GB/s; "
             f"ceiling {report['ceiling_gbs']:.0f} GB/s (FACTS.md); {report['nodes_per_chain']}-node chains in ORT "
             f"CUDA graphs, {report.get('instances', 1)} session(s) a variant; us per node (median over sessions "
             "of each session's median).", "",
             "| type | rows x H | op | ort_triton us | ORT us (its kernel) | speedup | ort_triton % of ceiling | "
             "spread ours / ORT |",
             "|---|---|---|---|---|---|---|---|"]
    for (t, rows, h, variant), ours in by.items():
        base, _, lib = variant.partition("@")  # "@name": a further --library, a candidate configuration
        for label, mine, theirs in PAIRS:
            if base == mine:
                ref = by[(t, rows, h, theirs)]
                label = f"{label} @{lib}" if lib else label
                lines.append(f"| {t} | {rows} x {h} | {label} | {ours['us_per_node']:.2f} | {ref['us_per_node']:.2f} "
                             f"({theirs.removeprefix('ort_')}) | {ref['us_per_node'] / ours['us_per_node']:.3f}x | "
                             f"{100 * ours['ceiling_frac']:.1f}% | {pct(ours)} / {pct(ref)} |")
    return "\n".join(lines) + "\n"


def _save(path: str, copy_gbs: float, instances: int, argv, rows: list[dict]) -> None:
    import os

    import torch

    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump({"gpu": torch.cuda.get_device_name(), "ceiling_gbs": CEILING_GBS, "copy_gbs_this_run": copy_gbs,
                   "nodes_per_chain": K, "instances": instances,
                   "command": "python -m ort_triton.bench.layer_norm " + " ".join(argv or []),
                   "rows": rows}, fh, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> None:
    import sys

    import torch

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--library", action="append", default=[],
                   help="libort_triton.so to benchmark; again as NAME=PATH for more builds (rows VARIANT@NAME)")
    p.add_argument("--json", required=True, help="where to write the rows (with --summarize: the rows to read)")
    p.add_argument("--summarize", action="store_true", help="print the markdown table of an earlier --json")
    p.add_argument("--rows", default="4096,65536")
    p.add_argument("--hidden", default="768,1024,4096,8192")
    p.add_argument("--types", default="float16")
    p.add_argument("--reps", type=int, default=20, help="replays per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--instances", type=int, default=3, help="sessions per variant (buffer placement varies)")
    args = p.parse_args(argv)
    if args.summarize:
        with open(args.json) as fh:
            print(summary(json.load(fh)), end="")
        return
    if not args.library:
        p.error("--library is required to run the benchmark")
    import triton

    libraries = [tuple(spec.split("=", 1)) if "=" in spec else ("", spec) for spec in args.library]
    src = torch.randn(2**29, device="cuda", dtype=torch.float16)  # 1 GiB, far past the 60 MB L2
    copy_ms = triton.testing.do_bench(functools.partial(torch.empty_like(src).copy_, src), warmup=50, rep=400,
                                      return_mode="median")
    copy_gbs = 2 * src.numel() * 2 / (copy_ms * 1e-3) / 1e9
    print(f"device-to-device copy in this run: {copy_gbs:.0f} GB/s (FACTS.md ceiling {CEILING_GBS:.0f})")
    rows_list = [int(v) for v in args.rows.split(",")]
    hidden_list = [int(v) for v in args.hidden.split(",")]
    results = []
    print(f"{'type':8} {'rows':>6} {'H':>5} {'variant':32} {'us/node':>8} {'spread':>7} {'GB/s':>7} {'ceil%':>6} "
          f"{'triton-only us':>14}")
    for type_name in args.types.split(","):
        dt = {"float16": torch.float16, "float": torch.float32}[type_name]
        for rows in rows_list:
            for hidden in hidden_list:
                x = torch.randn(rows, hidden, device="cuda", dtype=dt)
                r = torch.randn(rows, hidden, device="cuda", dtype=dt)
                # All variants of one shape are built first and then timed in interleaved rounds, so
                # clock or thermal drift hits every variant alike (a few % between runs otherwise).
                runners = {}
                try:
                    for variant, (_op, domain, _moved, residual) in VARIANTS.items():
                        feeds = {"x": x, **({"r": r} if residual else {})}
                        for label, lib in libraries if domain == DOMAIN else [("", None)]:
                            name = f"{variant}@{label}" if label else variant
                            model = chain_model(variant, hidden, type_name)
                            runners[name] = [make_runner(model, feeds, lib) for _ in range(args.instances)]
                except Exception as e:  # noqa: BLE001  (ORT's out-of-memory is a RuntimeError, torch's its own)
                    # every variant's sessions of a shape live at once: at 65536 x 8192 (1 GiB a tensor) four
                    # libraries x 3 sessions ran out of memory (session 12); the other shapes still count
                    print(f"{type_name:8} {rows:6} {hidden:5} skipped: {type(e).__name__}: {str(e)[:300]} (fewer "
                          "--instances or --library builds fit)", flush=True)
                    del runners, x, r
                    torch.cuda.empty_cache()
                    continue
                samples = {(v, i): [] for v, runs in runners.items() for i in range(len(runs))}
                for _ in range(args.rounds):
                    for variant, runs in runners.items():
                        for i, run in enumerate(runs):
                            samples[(variant, i)] += [run() for _ in range(args.reps)]
                for variant, runs in runners.items():
                    _op, domain, moved, _res = VARIANTS[variant.partition("@")[0]]
                    per_session = [statistics.median(samples[(variant, i)]) / K for i in range(len(runs))]
                    ms = statistics.median(per_session)
                    spread = (max(per_session) - min(per_session)) / ms
                    nbytes = moved * rows * hidden * x.element_size()
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    t_only = (triton_only(rows, hidden, variant, type_name)
                              if domain == DOMAIN and "@" not in variant else None)
                    row = dict(type=type_name, rows=rows, hidden=hidden, variant=variant, us_per_node=ms * 1e3,
                               us_per_node_sessions=[v * 1e3 for v in per_session], spread=spread,
                               bytes=nbytes, gbs=gbs, ceiling_frac=gbs / CEILING_GBS,
                               triton_only_us=t_only * 1e3 if t_only else None)
                    results.append(row)
                    print(f"{type_name:8} {rows:6} {hidden:5} {variant:32} {ms * 1e3:8.2f} {100 * spread:6.1f}% "
                          f"{gbs:7.0f} {100 * gbs / CEILING_GBS:5.1f}% "
                          f"{'' if t_only is None else f'{t_only * 1e3:14.2f}'}", flush=True)
                del runners
                _save(args.json, copy_gbs, args.instances, argv, results)  # after every shape: a cut run keeps it
    _save(args.json, copy_gbs, args.instances, argv, results)
    with open(args.json) as fh:
        print(summary(json.load(fh)), end="")


if __name__ == "__main__":
    main()
