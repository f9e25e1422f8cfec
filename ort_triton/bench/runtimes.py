"""The runtimes `ort-triton bench` compares, one small class each, behind one interface:

    reason = runtime.available(model)             # None, or why it cannot run here (the row is 'skipped')
    runner = runtime.prepare(model, shape, inputs)
    runner.run()                                  # one inference (on CUDA: may return before the GPU is done)
    runner.output()                               # one more inference, its first output as numpy
    runner.close()

Inputs are bound once, at prepare: CUDA graphs replay on fixed addresses, and the timed runs should not
include host-to-device copies. The dtype is the model's (`BenchModel.dtype`). Expensive shape-independent
work (graph rewrites, exports) is cached on the runtime object; sessions and compiled modules are made per
shape so each shape's memory reading is its own (see harness.py). The names are a stable interface: the
JSON rows, the plot and other tools read them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
from collections.abc import Callable

import numpy as np

CUDA_EP = "CUDAExecutionProvider"
TRT_EP = "TensorrtExecutionProvider"


@dataclasses.dataclass
class BenchModel:
    """What every runtime benchmarks: one ONNX file (in `dtype`) and, when built from a config, the same
    model in PyTorch (fp32, on the CPU; torch runtimes take a copy)."""

    name: str
    onnx: pathlib.Path
    dtype: str  # "float16" | "float32"
    device: str  # "cuda" | "cpu"
    export: dict  # exporter, opset, attn_implementation
    work: pathlib.Path  # scratch directory for rewritten models and engines
    config: object | None = None  # the transformers config, when known
    torch_model: object | None = None
    # (attn_implementation, dtype, exporter[, opset]) -> another export of the same weights, made on demand;
    # only for a model exported here (a given file's weights are not the config's)
    export_as: Callable[..., pathlib.Path] | None = None


class Runtime:
    name = ""
    family = "onnx"  # which reference its accuracy is measured against: "onnx" or "torch"
    info = ""  # what it did to the model (fusions, mode), set by prepare for the rows

    def available(self, model: BenchModel) -> str | None:
        return None

    def prepare(self, model: BenchModel, shape: tuple[int, int], inputs: dict):
        raise NotImplementedError


# ---- ONNX Runtime ------------------------------------------------------------------------------------
def _ort_cuda_reason(model: BenchModel) -> str | None:
    import onnxruntime as ort

    if model.device == "cuda" and CUDA_EP not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no {CUDA_EP} (a CPU build; install onnxruntime-gpu)"
    return None


_NP_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
             "tensor(float16)": np.float16}


class OrtRunner:
    """IO binding on the session's device: inputs copied there once, outputs left there by ORT."""

    def __init__(self, sess, inputs: dict, device: str):
        import onnxruntime as ort

        self.sess, self.io = sess, sess.io_binding()
        # kept alive with the runner: a CUDA graph replays on these addresses
        self.values = {}
        for inp in sess.get_inputs():
            if inp.name not in inputs:
                raise ValueError(f"the session wants input {inp.name!r}; the bench made {sorted(inputs)}")
            arr = inputs[inp.name].astype(_NP_TYPES.get(inp.type, inputs[inp.name].dtype), copy=False)
            self.values[inp.name] = ort.OrtValue.ortvalue_from_numpy(arr, device, 0)
            self.io.bind_ortvalue_input(inp.name, self.values[inp.name])
        for out in sess.get_outputs():
            self.io.bind_output(out.name, device)

    def run(self) -> None:
        self.sess.run_with_iobinding(self.io)

    def output(self) -> np.ndarray:
        self.run()
        return self.io.copy_outputs_to_cpu()[0]

    def close(self) -> None:
        self.io = self.values = self.sess = None


class OrtStock(Runtime):
    """ORT with all its graph optimizations on the model as given."""

    name = "ort_stock"
    cuda_graph = False

    def __init__(self):
        self._files: dict[pathlib.Path, pathlib.Path | Exception] = {}

    def available(self, model):
        if self.cuda_graph and model.device != "cuda":
            return "CUDA graphs need --device cuda"
        return _ort_cuda_reason(model)

    def rewrite(self, model: BenchModel) -> pathlib.Path:
        """The model file this runtime runs (rewritten once per model, then reused for every shape)."""
        return model.onnx

    def session_options(self):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3  # errors only: ORT's warnings (Memcpy nodes, ...) would bury the results
        return so

    def providers(self, model: BenchModel) -> list:
        if model.device != "cuda":
            return ["CPUExecutionProvider"]
        return [(CUDA_EP, {"enable_cuda_graph": "1"} if self.cuda_graph else {})]

    def session(self, path: pathlib.Path, model: BenchModel):
        import onnxruntime as ort

        return ort.InferenceSession(str(path), self.session_options(), providers=self.providers(model))

    def prepare(self, model, shape, inputs):
        if model.onnx not in self._files:
            try:
                self._files[model.onnx] = self.rewrite(model)
            except Exception as e:  # noqa: BLE001  (kept: a failed rewrite is not retried at every shape)
                self._files[model.onnx] = e
        if isinstance(self._files[model.onnx], Exception):
            raise self._files[model.onnx]
        sess = self.session(self._files[model.onnx], model)
        want = _provider_name(self.providers(model)[0])
        if want not in sess.get_providers():  # ORT falls back to CPU when an EP fails to load, silently
            raise RuntimeError(f"{want} did not load (session runs on {sess.get_providers()})")
        return OrtRunner(sess, inputs, "cuda" if model.device == "cuda" else "cpu")


def _provider_name(p) -> str:
    return p[0] if isinstance(p, tuple) else p


class OrtStockCudaGraph(OrtStock):
    """ORT stock with its CUDA graph: capture fails when a node runs outside the CUDA EP (Memcpy nodes);
    then the row carries ORT's message."""

    name = "ort_stock_cuda_graph"
    cuda_graph = True


def _nonzero(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if v) or "nothing fused"


class OrtOptimizer(OrtStock):
    """onnxruntime.transformers.optimizer (ORT's own BERT fusions), fed what it was written for when the
    bench made the model: the torchscript exporter's fp32 export with attn_implementation="eager", the only
    one whose Attention and EmbedLayerNormalization it fuses (on sdpa or dynamo exports it fuses no
    attention and is 2-5x slower at long sequences: shared/notes/FACTS.md); then, for fp16, its own
    convert_float_to_float16, as ORT documents. Same weights as the other rows. A given file is fused as
    it is."""

    name = "ort_optimizer"
    best_case = True  # the eager torchscript export when the bench made the model

    def rewrite(self, model):
        from onnxruntime.transformers.optimizer import MODEL_TYPES, optimize_model

        cfg = model.config
        model_type = getattr(cfg, "model_type", "bert")
        model_type = model_type if model_type in MODEL_TYPES else "bert"  # roberta, distilbert: BERT fusions
        ours = model.export_as is not None and self.best_case
        convert = ours and model.dtype == "float16"
        src = model.export_as("eager", "float32", "torchscript") if ours else model.onnx
        # 0 heads / hidden: the optimizer detects them from the graph
        opt = optimize_model(str(src), model_type=model_type, num_heads=getattr(cfg, "num_attention_heads", 0),
                             hidden_size=getattr(cfg, "hidden_size", 0), use_gpu=model.device == "cuda")
        self.info = _nonzero(opt.get_fused_operator_statistics())
        if ours:
            self.info += "; on the torchscript eager-attention fp32 export"
        if convert:
            opt.convert_float_to_float16(keep_io_types=False)
            self.info += ", fp16 by its convert_float_to_float16"
        out = model.work / f"{self.name}.onnx"
        opt.save_model_to_file(str(out))
        return out


class OrtOptimizerSameExport(OrtOptimizer):
    """ORT's transformers optimizer on the very file the other rows run (the bench's export, sdpa by
    default), in its dtype: what a user gets who feeds it today's default export."""

    name = "ort_optimizer_same_export"
    best_case = False


class OnnxscriptFusions(OrtStock):
    """onnxscript's ORT fusions (optimize_for_ort: SkipLayerNorm, MHA/Attention, BiasGelu, ...), then ORT."""

    name = "onnxscript_fusions"

    def rewrite(self, model):
        import onnx_ir as ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        optimized, counts = optimize_for_ort(ir.load(str(model.onnx)))
        self.info = _nonzero(counts)
        out = model.work / f"{self.name}.onnx"
        ir.save(optimized, str(out))
        return out


def library_reason() -> str | None:
    """Why ort_triton cannot run on CUDA here (no libort_triton.so), or None."""
    from ..runtime import LibraryNotFound, get_library_path

    try:
        get_library_path()
    except LibraryNotFound as e:
        return str(e)
    return None


TUNED_LIBRARY_ENV = "ORT_TRITON_TUNED_LIBRARY"


class OrtTriton(OrtStock):
    """graph_rewrites.optimize, then an ORT session with the ort_triton library (on CUDA; on the CPU the
    ops run their ONNX function bodies)."""

    name = "ort_triton"
    library = None  # the default library (get_library_path)
    disable: tuple[str, ...] = ()  # graph_rewrites rules left out (an ablation runtime's one difference)
    enable: tuple[str, ...] = ()  # rules off by default put in (a candidate runtime's one difference)

    def available(self, model):
        reason = super().available(model)
        return reason if reason or model.device != "cuda" else library_reason()

    def rewrite(self, model):
        import onnx

        import graph_rewrites

        optimized, report = graph_rewrites.optimize(str(model.onnx), report=True, disable=list(self.disable),
                                                enable=list(self.enable))
        self.info = self.fused = _nonzero({r.name: r.matched for r in report.rules.values()})
        out = model.work / f"{self.name}.onnx"
        onnx.save(optimized, str(out))
        return out

    def session(self, path, model):
        from ..runtime import make_session

        return make_session(path, providers=self.providers(model), session_options=self.session_options(),
                            library=self.library)

    def prepare(self, model, shape, inputs):
        runner = super().prepare(model, shape, inputs)
        if model.device == "cuda":  # proof that our kernels ran rather than the function bodies
            from ..runtime import launch_count

            before = launch_count(self.library)
            runner.run()  # the first run of a session is never a graph replay, so every launch counts
            launches = launch_count(self.library) - before
            self.info = (f"{self.fused}; {launches} library kernel launches in the first run" +
                         (" (ORT runs the model more than once in it, then captures the graph)" if self.cuda_graph
                          else ""))
        return runner


class OrtTritonCudaGraph(OrtTriton):
    name = "ort_triton_cuda_graph"
    cuda_graph = True


class OrtTritonLinearCudaGraph(OrtTritonCudaGraph):
    """ort_triton_cuda_graph with the rule linear (off by default: 0.95-0.99x on BERT-base, session 23): every
    MatMul by a constant weight as Linear (cuBLAS's TN GEMM on the transposed weight beyond one row). Opt-in."""

    name = "ort_triton_linear_cuda_graph"
    enable = ("linear",)


def tuned_library_reason() -> str | None:
    path = os.environ.get(TUNED_LIBRARY_ENV)
    if not path:
        return f"set {TUNED_LIBRARY_ENV} to a library built with `ort-triton build --tuning TABLE`"
    return None if pathlib.Path(path).is_file() else f"{TUNED_LIBRARY_ENV}={path}: no such file"


class OrtTritonTuned(OrtTriton):
    """ort_triton with the library of a tuning table ($ORT_TRITON_TUNED_LIBRARY, `ort-triton build --tuning`),
    beside ort_triton's default library in the same run: what tuning buys (opt-in: --runtimes)."""

    name = "ort_triton_tuned"

    def available(self, model):
        reason = super().available(model)
        if reason or model.device != "cuda":
            return reason or "the tuned library runs on CUDA only"
        reason = tuned_library_reason()
        if not reason:
            self.library = os.environ[TUNED_LIBRARY_ENV]
        return reason


class OrtTritonTunedCudaGraph(OrtTritonTuned):
    name = "ort_triton_tuned_cuda_graph"
    cuda_graph = True


def _ablation(name: str, disable: tuple[str, ...], doc: str) -> tuple[type[OrtTriton], type[OrtTriton]]:
    """ort_triton with `disable`'s rules off, and its CUDA-graph twin: beside the default fusion in the same
    run, what those rules buy (opt-in: --runtimes)."""
    plain = type(f"OrtTriton_{name}", (OrtTriton,), dict(name=f"ort_triton_{name}", disable=disable, __doc__=doc))
    graph = type(f"OrtTriton_{name}_cuda_graph", (plain,), dict(name=f"ort_triton_{name}_cuda_graph", cuda_graph=True))
    return plain, graph


# name: (rules turned off, what the runtime is)
ABLATIONS = {
    "unpacked": (("pack_qkv",), "three projection GEMMs and MultiHeadAttention, not one packed GEMM"),
    "unfused_embeddings": (("embed_layer_norm",), "the embeddings' Gathers and Adds, then AddLayerNorm"),
}
_ABLATED = [cls for name, (rules, doc) in ABLATIONS.items() for cls in _ablation(name, rules, doc)]


# ---- PyTorch ---------------------------------------------------------------------------------------
class TorchRunner:
    def __init__(self, fn, before_call=None, on_close=None, keep=()):
        self.fn, self.before_call, self.on_close = fn, before_call, on_close
        self.keep = keep  # what must live as long as the runner (a TensorRT context and its buffers)

    def run(self) -> None:
        if self.before_call:
            self.before_call()
        self.fn()  # the output is dropped: cudagraph trees may reuse its memory on the next replay

    def output(self) -> np.ndarray:
        if self.before_call:
            self.before_call()
        return self.fn().float().cpu().numpy()

    def close(self) -> None:
        self.fn = self.keep = None
        if self.on_close:
            self.on_close()


class TorchEager(Runtime):
    name = "torch_eager"
    family = "torch"

    def available(self, model):
        if model.torch_model is None:
            return "needs the PyTorch model: pass --hf-config"
        return None

    def prepare(self, model, shape, inputs):
        import copy

        import torch

        dtype = getattr(torch, model.dtype)
        self.info = f"attn_implementation={model.config._attn_implementation}"
        tensors = {k: torch.from_numpy(v).to(model.device) for k, v in inputs.items()}
        tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
        # a fresh copy on the device, freed with the runner, so the memory reading is this shape's
        fn = self.wrap(copy.deepcopy(model.torch_model).to(model.device, dtype))
        return TorchRunner(torch.inference_mode()(lambda: fn(**tensors)[0]), *self.hooks())

    def wrap(self, module):
        return module

    def hooks(self) -> tuple:
        """(before each call, after the runner closes)."""
        return None, None


class TorchCompile(TorchEager):
    """torch.compile, static shapes. Mode "default" rather than max-autotune-no-cudagraphs: autotuning every
    GEMM of every shape takes minutes per shape, past what one benchmark run on the device can spend."""

    name = "torch_compile"
    mode = "default"

    def available(self, model):
        if self.mode == "reduce-overhead" and model.device != "cuda":
            return "CUDA graphs need --device cuda"
        return super().available(model)

    def wrap(self, module):
        import torch

        self.info += f", mode={self.mode}, dynamic=False"
        return torch.compile(module, mode=self.mode, dynamic=False)

    def hooks(self):
        import torch

        # one compile per shape from a clean state (no recompile limit, no earlier shape's guards), and
        # cudagraph trees' memory pool freed before the next runtime's memory baseline
        return None, torch._dynamo.reset


class TorchCompileCudaGraph(TorchCompile):
    name = "torch_compile_cuda_graph"
    mode = "reduce-overhead"

    def hooks(self):
        import torch

        # each call a new step, so cudagraph trees replay instead of guarding against live outputs
        return torch.compiler.cudagraph_mark_step_begin, super().hooks()[1]


# ---- TensorRT ---------------------------------------------------------------------------------------
def _libnvinfer() -> bool:
    for name in ("libnvinfer.so.10", "libnvinfer.so"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


class TensorRT(Runtime):
    """ORT's TensorRT EP when it can load TensorRT, else the tensorrt Python API (10.x); one engine per
    shape (min = opt = max profile), FP16 enabled for fp16 models."""

    name = "tensorrt"

    def available(self, model):
        import importlib.util

        import onnxruntime as ort

        if model.device != "cuda":
            return "TensorRT needs --device cuda"
        if self._via_ort() or importlib.util.find_spec("tensorrt"):
            return None
        return ("no TensorRT: ORT's TensorRT EP is " + ("listed but libnvinfer is not loadable" if TRT_EP in
                ort.get_available_providers() else "not in this build") + ", and no tensorrt Python package")

    @staticmethod
    def _via_ort() -> bool:
        import onnxruntime as ort

        return TRT_EP in ort.get_available_providers() and _libnvinfer()

    def prepare(self, model, shape, inputs):
        return self._ort(model, inputs) if self._via_ort() else self._native(model, inputs)

    def _ort(self, model, inputs):
        import onnxruntime as ort

        dims = ",".join(f"{k}:{'x'.join(map(str, v.shape))}" for k, v in inputs.items())
        (model.work / "trt").mkdir(exist_ok=True)
        opts = {"trt_fp16_enable": model.dtype == "float16", "trt_engine_cache_enable": True,
                "trt_engine_cache_path": str(model.work / "trt"), "trt_profile_min_shapes": dims,
                "trt_profile_opt_shapes": dims, "trt_profile_max_shapes": dims}
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(str(model.onnx), so, providers=[(TRT_EP, opts), CUDA_EP])
        if TRT_EP not in sess.get_providers():
            raise RuntimeError(f"{TRT_EP} did not load (session runs on {sess.get_providers()})")
        self.info = "ORT TensorRT EP"
        return OrtRunner(sess, inputs, "cuda")

    def _native(self, model, inputs):
        import tensorrt as trt
        import torch

        if int(trt.__version__.split(".")[0]) < 10:
            raise RuntimeError(f"tensorrt {trt.__version__}: the bench uses the 10.x API")
        logger = trt.Logger(trt.Logger.ERROR)
        builder = trt.Builder(logger)
        network = builder.create_network(0)  # 10.x: always explicit batch
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(model.onnx)):
            raise RuntimeError("TensorRT ONNX parser: " + "; ".join(str(parser.get_error(i))
                                                                    for i in range(parser.num_errors)))
        config = builder.create_builder_config()
        if model.dtype == "float16":
            config.set_flag(trt.BuilderFlag.FP16)
        profile = builder.create_optimization_profile()
        for name, arr in inputs.items():
            profile.set_shape(name, arr.shape, arr.shape, arr.shape)
        config.add_optimization_profile(profile)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise RuntimeError("TensorRT engine build failed")
        engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
        ctx = engine.create_execution_context()
        buffers, outputs = {}, []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            dtype = torch.from_numpy(np.empty(0, trt.nptype(engine.get_tensor_dtype(name)))).dtype
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                ctx.set_input_shape(name, inputs[name].shape)
                buffers[name] = torch.from_numpy(inputs[name]).to("cuda", dtype)
            else:
                buffers[name] = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=dtype, device="cuda")
                outputs.append(name)
            ctx.set_tensor_address(name, buffers[name].data_ptr())
        stream = torch.cuda.Stream()  # TensorRT syncs extra on the legacy default stream

        def run():
            stream.wait_stream(torch.cuda.current_stream())
            if not ctx.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed")
            torch.cuda.current_stream().wait_stream(stream)  # the harness's CUDA events see the engine's work
            return buffers[outputs[0]]

        self.info = f"tensorrt {trt.__version__} Python API"
        return TorchRunner(run, keep=(engine, ctx, buffers, stream))


RUNTIMES: dict[str, type[Runtime]] = {cls.name: cls for cls in (
    OrtStock, OrtStockCudaGraph, OrtOptimizer, OnnxscriptFusions, OrtTriton, OrtTritonCudaGraph,
    TorchEager, TorchCompile, TorchCompileCudaGraph, TensorRT, OrtOptimizerSameExport, OrtTritonTuned,
    OrtTritonTunedCudaGraph, OrtTritonLinearCudaGraph, *_ABLATED)}
# what runs when --runtimes is not given: the tuned library (it needs a tuning table first) and the
# ablations are opt-in
DEFAULT_RUNTIMES = tuple(n for n in RUNTIMES
                         if not n.startswith(("ort_triton_tuned", "ort_triton_linear",
                                              *(f"ort_triton_{a}" for a in ABLATIONS))))
# ort_triton's own rows; every other runtime is a peer ("best peer" in the report)
OURS = ("ort_triton", "ort_triton_cuda_graph", "ort_triton_tuned", "ort_triton_tuned_cuda_graph",
        "ort_triton_linear_cuda_graph",
        *(cls.name for cls in _ABLATED))
