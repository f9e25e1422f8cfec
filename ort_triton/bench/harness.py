"""`ort-triton bench`: one model, several runtimes, the same inputs, in one process.

    rows = bench("model.onnx", shapes=[(1, 128), (8, 512)], runtimes=["ort_stock", "ort_triton"])
    rows = bench(hf_config="bert-base", dtype="float16")           # builds and exports the model itself

Per (shape, runtime): a fresh session or module (`runtimes.py`), `warmup` untimed runs, then `iters` runs
timed one by one, so p50/p90/p99 are of single-inference latencies. On cuda each run is timed with CUDA
events on the current stream around the call (ORT's Run returns once its stream is done; torch work is
on that stream), inputs already on the device; on cpu with time.perf_counter.

Memory (`peak_mem_mb`, cuda only): device memory in use by everyone (cudaMemGetInfo: total - free) after
the warm-up and after the timed runs, the larger, minus the same reading just before the runtime's
session/module for this shape was made. So it counts weights, ORT's arena, torch's caching allocator,
workspaces and graph pools, not the CUDA context. torch.cuda.max_memory_allocated would miss ORT's arena.
Both allocators keep their high-water mark, so this is the peak of what they pooled.

Accuracy: the first output against an fp32 reference on the same inputs: the fp32 PyTorch model (on the
device, TF32 off) when built from a config, else the fp32 ONNX model on ORT's CPU EP (none for an fp16
file: there is no fp32 model to compare with). Positions the attention mask pads are left out: what a
runtime writes there is unspecified.
"""

from __future__ import annotations

import copy
import functools
import gc
import importlib.metadata
import pathlib
import platform
import subprocess
import tempfile
import time
import types

import numpy as np
import onnx

from ..compare import diff, random_inputs
from . import report
from .runtimes import DEFAULT_RUNTIMES, RUNTIMES, BenchModel

DEFAULT_SHAPES = ((1, 128), (8, 128), (8, 512))
MEM_METHOD = "cudaMemGetInfo (total - free) after the runs minus before the session was made"


class BenchError(ValueError):
    """Bad arguments (the CLI prints it and exits 2)."""


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x128,8x512' -> [(1, 128), (8, 512)]."""
    shapes = []
    for part in text.split(","):
        b, _, s = part.strip().lower().partition("x")
        if not (b.isdigit() and s.isdigit() and int(b) > 0 and int(s) > 0):
            raise BenchError(f"bad shape {part!r}: want BATCHxSEQ, e.g. 8x512")
        shapes.append((int(b), int(s)))
    return shapes


# ---- timing ----------------------------------------------------------------------------------------
class Clock:
    """Milliseconds of one call: CUDA events on cuda (the GPU's time from the call to the end of its work,
    launch overhead included), time.perf_counter on cpu."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        if self.cuda:
            import torch

            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def time(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


def _used_mb() -> float:
    import torch

    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- the model and its inputs ----------------------------------------------------------------------
_ELEM = {1: "float32", 10: "float16"}  # onnx.TensorProto FLOAT, FLOAT16


def _elem_dtype(proto) -> str:
    elem = proto.graph.output[0].type.tensor_type.elem_type
    if elem not in _ELEM:
        raise BenchError(f"the model's first output has ONNX element type {elem}; the bench takes float16 "
                         "or float32 models")
    return _ELEM[elem]


def _opset(proto) -> int | None:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)


def load_model(path, hf_config, dtype, device, exporter, work: pathlib.Path, shapes, opset=None) -> BenchModel:
    """The BenchModel for a file and/or a config. With a config and no file the model is exported here, in
    `dtype`; other exports of the same weights are made on demand (`BenchModel.export_as`)."""
    from .. import models

    torch_model = config = None
    if hf_config:
        if hf_config not in models.CONFIGS:
            raise BenchError(f"unknown --hf-config {hf_config!r}; known: {', '.join(models.CONFIGS)}")
        torch_model = models.build(hf_config)
        config = torch_model.config
        limit = getattr(config, "max_position_embeddings", None)
        if limit and any(s > limit for _, s in shapes):  # checked before the export, which takes a while
            raise BenchError(f"{hf_config} takes at most {limit} positions; shapes {shapes} go past it")
    if path:
        path = pathlib.Path(path)
        if opset:
            raise BenchError("--opset is for the export --hf-config makes; a model file has its own")
        if not path.is_file():
            raise BenchError(f"{path}: no such file")
        proto = onnx.load(str(path), load_external_data=False)
        own = _elem_dtype(proto)
        if dtype and dtype != own:
            raise BenchError(f"{path.name} is {own}; --dtype {dtype} needs --hf-config without a model file "
                             "(the bench does not convert models)")
        export = {"exporter": f"{proto.producer_name} {proto.producer_version}".strip() or "unknown",
                  "opset": _opset(proto), "attn_implementation": None, "file": path.name}
        return BenchModel(path.stem, path, own, device, export, work, config, torch_model)
    if not hf_config:
        raise BenchError("give a MODEL.onnx or --hf-config NAME")
    dtype = dtype or ("float16" if device == "cuda" else "float32")

    attn = config._attn_implementation

    @functools.cache
    def export_as(attn_implementation: str, as_dtype: str, by: str, at_opset: int | None = None) -> pathlib.Path:
        # models.build is seeded: another attention implementation has the same weights
        m = torch_model if attn_implementation == attn else models.build(hf_config,
                                                                          attn_implementation=attn_implementation)
        m = copy.deepcopy(m).half() if as_dtype == "float16" else m
        return models.export(m, work / f"{hf_config}.{attn_implementation}.{as_dtype}.{by}.onnx", exporter=by,
                             opset=at_opset)

    onnx_path = export_as(attn, dtype, exporter, opset)
    proto = onnx.load(str(onnx_path), load_external_data=False)
    export = {"exporter": exporter, "opset": _opset(proto), "attn_implementation": attn}
    return BenchModel(hf_config, onnx_path, dtype, device, export, work, config, torch_model, export_as=export_as)


_ORT_TYPE = {1: "tensor(float)", 10: "tensor(float16)", 7: "tensor(int64)", 6: "tensor(int32)"}


def _graph_inputs(proto):
    """compare.random_inputs reads a session's get_inputs(); this gives it the same from the graph, so no
    session is needed (an fp16 model may have no CPU kernels to make one with)."""
    inits = {t.name for t in proto.graph.initializer}
    specs = []
    for vi in proto.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        specs.append(types.SimpleNamespace(name=vi.name, type=_ORT_TYPE.get(tt.elem_type, "tensor(int64)"),
                                           shape=[d.dim_value or d.dim_param for d in tt.shape.dim]))
    return types.SimpleNamespace(get_inputs=lambda: specs)


def _vocab_size(proto, config) -> int:
    """Token ids must index the embedding: the config's vocabulary, else the rows of the table that the
    first integer input is gathered from."""
    if config is not None:
        return config.vocab_size
    inits = {t.name: t for t in proto.graph.initializer}
    ids = {vi.name for vi in proto.graph.input if vi.type.tensor_type.elem_type in (6, 7) and "mask" not in vi.name}
    for node in proto.graph.node:
        if node.op_type == "Gather" and node.input[1] in ids and node.input[0] in inits:
            return inits[node.input[0]].dims[0]
    return 2  # no embedding found: ids 0 and 1 are valid indices for any table


def _valid_positions(inputs: dict, out: np.ndarray):
    mask = inputs.get("attention_mask")
    if mask is not None and out.shape[:2] == mask.shape:
        return mask.astype(bool)
    return ...


def references(model: BenchModel, shape_inputs: dict) -> dict:
    """{shape: {"onnx": (array, what) | None, "torch": ...}}: the fp32 reference for each family."""
    refs = {shape: {} for shape in shape_inputs}
    if model.torch_model is not None:
        import torch

        what = f"torch fp32 ({model.device}{', no TF32' if model.device == 'cuda' else ''})"
        ref = copy.deepcopy(model.torch_model).to(model.device)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            with torch.inference_mode():
                for shape, inputs in shape_inputs.items():
                    t = {k: torch.from_numpy(v).to(model.device) for k, v in inputs.items()}
                    t = {k: v.float() if v.is_floating_point() else v for k, v in t.items()}
                    refs[shape]["torch"] = (ref(**t)[0].float().cpu().numpy(), what)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            del ref
            _release(model.device)
    exported_here = model.export_as is not None  # then the ONNX model has the torch model's weights
    for shape in shape_inputs:
        refs[shape]["onnx"] = refs[shape].get("torch") if exported_here else None
    if not exported_here and model.dtype == "float32":
        import onnxruntime as ort

        sess = ort.InferenceSession(str(model.onnx), providers=["CPUExecutionProvider"])
        for shape, inputs in shape_inputs.items():
            feeds = {i.name: inputs[i.name] for i in sess.get_inputs()}
            refs[shape]["onnx"] = (sess.run(None, feeds)[0], "onnxruntime CPU fp32")
    return refs


# ---- environment -----------------------------------------------------------------------------------
def _dist_version(*dists) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def environment(device: str) -> tuple[str | None, dict]:
    """(GPU name, package versions) for every row."""
    import onnxruntime as ort

    from .. import __version__

    versions = {"python": platform.python_version(), "onnxruntime": ort.__version__,
                "onnxruntime_providers": ",".join(ort.get_available_providers()), "ort_triton": __version__}
    for dist in ("onnx", "onnxscript", "onnx-ir", "numpy", "torch", "transformers", "triton", "tensorrt"):
        versions[dist] = _dist_version(dist)
    try:
        versions["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                         cwd=pathlib.Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        versions["git"] = None
    gpu = None
    if device == "cuda":
        import torch

        gpu = torch.cuda.get_device_name()
        versions["cuda"] = torch.version.cuda
    return gpu, versions


# ---- the loop ----------------------------------------------------------------------------------------
def _short(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:400] if lines else ''}".rstrip(": ")


def _measure(rt, model, shape, inputs, ref, warmup, iters, clock) -> dict:
    if model.device == "cuda":
        _release(model.device)
        base = _used_mb()
    runner = rt.prepare(model, shape, inputs)
    try:
        for _ in range(warmup):
            runner.run()
        peak = _used_mb() if model.device == "cuda" else None
        times = [clock.time(runner.run) for _ in range(iters)]
        if model.device == "cuda":
            peak = max(peak, _used_mb())
        out = runner.output()
    finally:
        runner.close()
        del runner
        _release(model.device)
    p50, p90, p99 = (float(v) for v in np.percentile(times, [50, 90, 99]))
    row = dict(status="ok", p50_ms=p50, p90_ms=p90, p99_ms=p99, throughput_seq_s=shape[0] / p50 * 1e3,
               peak_mem_mb=None if peak is None else peak - base, info=rt.info)
    if ref is not None:
        (want, what), keep = ref, _valid_positions(inputs, ref[0])
        d = diff("output", want[keep], out[keep] if out.shape == want.shape else out, float("inf"))
        row.update(max_abs_err=d.max_abs, mean_abs_err=d.mean_abs, rel_err=d.rel, reference=what)
    return row


def bench(model=None, *, hf_config: str | None = None, shapes=DEFAULT_SHAPES, runtimes=None,
          dtype: str | None = None, exporter: str = "dynamo", opset: int | None = None, warmup: int = 20,
          iters: int = 200, device: str = "cuda", out_dir=None, log=print, command: str | None = None) -> list[dict]:
    """Benchmark `model` (a path) and/or the model of `hf_config` on each runtime at each (batch, seq).
    Returns one row per (shape, runtime); with `out_dir`, writes JSON, CSV and the table (.md) after every
    shape and the PNG at the end (report.py). Runtimes that cannot run are 'skipped' rows, failures 'failed' rows."""
    names = list(runtimes or DEFAULT_RUNTIMES)
    unknown = [n for n in names if n not in RUNTIMES]
    if unknown:
        raise BenchError(f"unknown runtime(s) {', '.join(unknown)}; known: {', '.join(RUNTIMES)}")
    if device not in ("cuda", "cpu"):
        raise BenchError(f"device must be cuda or cpu, not {device!r}")
    if dtype not in (None, "float16", "float32"):
        raise BenchError(f"dtype must be float16 or float32, not {dtype!r}")
    if warmup < 0 or iters < 1:
        raise BenchError("need warmup >= 0 and iters >= 1")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BenchError("no CUDA device for torch (the bench times with CUDA events): use --device cpu")
    gpu, versions = environment(device)
    with tempfile.TemporaryDirectory(prefix="ort_triton_bench_") as work:
        subject = load_model(model, hf_config, dtype, device, exporter, pathlib.Path(work), shapes, opset)
        log(f"bench {subject.name} ({subject.dtype}, {subject.export}) on {gpu or 'cpu'}, "
            f"{warmup} warm-up + {iters} timed runs per shape")
        proto = onnx.load(str(subject.onnx), load_external_data=False)
        spec, vocab = _graph_inputs(proto), _vocab_size(proto, subject.config)
        shape_inputs = {shape: random_inputs(spec, *shape, vocab) for shape in shapes}
        refs = references(subject, shape_inputs)
        chosen = [RUNTIMES[n]() for n in names]
        reasons = {}
        for rt in chosen:
            try:
                reasons[rt.name] = ("skipped", rt.available(subject))
            except Exception as e:  # noqa: BLE001  (a broken install: report it, bench the others)
                reasons[rt.name] = ("failed", _short(e))
            if reasons[rt.name][1]:
                log(f"{rt.name}: {reasons[rt.name][0]}: {reasons[rt.name][1]}")
        clock = Clock(device)
        rows = []
        for shape in shapes:
            for rt in chosen:
                row = dict(model=subject.name, export=subject.export, dtype=subject.dtype, device=device,
                           batch=shape[0], seq=shape[1], runtime=rt.name, status=None, error=None, p50_ms=None,
                           p90_ms=None, p99_ms=None, throughput_seq_s=None, peak_mem_mb=None,
                           mem_method=MEM_METHOD if device == "cuda" else None, max_abs_err=None,
                           mean_abs_err=None, rel_err=None, reference=None, info=None, warmup=warmup,
                           iters=iters, gpu=gpu, versions=versions, command=command)
                status, reason = reasons[rt.name]
                if reason:
                    row.update(status=status, error=reason)
                else:
                    try:
                        row.update(_measure(rt, subject, shape, shape_inputs[shape], refs[shape].get(rt.family),
                                            warmup, iters, clock))
                    except Exception as e:  # noqa: BLE001  (one runtime failing must not stop the others)
                        row.update(status="failed", error=_short(e))
                        _release(device)
                if row["status"] != "skipped":  # skips were said once, above
                    log(_progress(row))
                rows.append(row)
            report.add_speedups(rows)
            if out_dir:
                report.save(rows, out_dir, plot_png=False)
    report.add_speedups(rows)
    if out_dir:
        for path in report.save(rows, out_dir, log=log):
            log(f"wrote {path}")
    return rows


def _progress(row: dict) -> str:
    head = f"{row['batch']:>3}x{row['seq']:<5} {row['runtime']:<25}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row['error']}"
    mem = f"  {row['peak_mem_mb']:7.0f} MB" if row["peak_mem_mb"] is not None else ""
    err = f"  max_abs_err {row['max_abs_err']:.2e}" if row["max_abs_err"] is not None else ""
    return (f"{head} p50 {row['p50_ms']:9.3f} ms  p99 {row['p99_ms']:9.3f} ms  "
            f"{row['throughput_seq_s']:9.1f} seq/s{mem}{err}")
