"""Decoder latency, prefill and decode, side by side: ORT stock, ORT on the opset-23 export (its Attention,
RMSNormalization and RotaryEmbedding ops) with and without CUDA graphs, onnxscript's optimize_for_ort, ORT's
transformers optimizer (GPT-2), ort_triton with and without CUDA graphs, and PyTorch; one process, same
model and weights, same inputs, CUDA events, median of many runs.

    python -m ort_triton.bench.decoder --model llama-1b --prefill 1x512,8x512,1x2048,8x2048 \
        --decode 1x1024,16x1024,1x4096,16x4096 --json OUT.json

Prefill BxS: a prompt of S tokens, no past. Decode BxP: one new token per row over a cache of P positions
(the step is timed alone, on the same inputs each time). Each ORT runtime keeps one session for every shape;
with CUDA graphs, each shape gets its own graph (run option gpu_graph_id) on fixed buffers. ORT refuses to
capture the dynamic cache exports (their shape subgraphs run on the CPU), so the *_static runtimes, ORT's own
and ours alike, run the model specialised for each shape (one session per shape), which it captures.
What a decode step must move at least: every weight once (the input embedding only for the B rows it
gathers) and the cache it reads, 2 x layers x B x kv_heads x P x head_dim elements; the bandwidth column
is that over the time, against the 4.08 TB/s copy ceiling (FACTS.md). The exports' KV cache is a Concat,
so every step also copies the whole past into present: not counted in the bandwidth column, and a reason a
step cannot reach the ceiling; `bytes_cache_copy` (2 x the cache: read and written) and
`ceiling_fraction_with_copy` count it, the GPU's traffic rather than the step's least. Prefill FLOPs:
2 x (non-embedding) params x B x S + causal attention.
Accuracy: every runtime's last-token logits against the same module in float32 (the weights of the fp16
model, widened), as the max abs difference, that over the reference's largest logit, and the share of rows
whose top token agrees. A shape longer than the model's position table is a skipped row, not a run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import numpy as np

from .. import decoders
from .harness import Clock, _release, _short, environment
from .profile import summary_lines, trace
from .runtimes import TUNED_LIBRARY_ENV, library_reason, tuned_library_reason

CEILING_GBS = 4080.0
RUNTIMES = ("ort_stock", "ort_opset23", "ort_opset23_cuda_graph", "ort_opset23_static_cuda_graph",
            "onnxscript_fusions", "ort_optimizer", "ort_optimizer_static_cuda_graph", "ort_triton", "ort_triton_static",
            "ort_triton_cuda_graph", "torch_eager")
ELEM_BYTES = {"float16": 2, "float32": 4}
PREFILL = "1x512,8x512,1x2048,8x2048"  # the default shapes (bench.ab --decoder's too)
DECODE = "1x1024,16x1024,1x4096,16x4096"


def parse(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        b, _, n = item.lower().partition("x")
        out.append((int(b), int(n)))
    return out


def done(path: pathlib.Path) -> bool:
    """Whether a file of the work directory was finished (a run cut short leaves no marker)."""
    return path.exists() and path.with_name(path.name + ".done").exists()


def mark_done(path: pathlib.Path, info: str = "") -> None:
    path.with_name(path.name + ".done").write_text(info)


class Model:
    """The transformers model, its exports (made on first use) and the counts the rows need."""

    def __init__(self, name: str, dtype: str, device: str, work: pathlib.Path):
        import torch

        self.name, self.dtype, self.device, self.work = name, dtype, device, work
        self.torch_dtype = {"float16": torch.float16, "float32": torch.float32}[dtype]
        self.model = decoders.build(name, dtype=self.torch_dtype)
        self.config = self.model.config
        self.layers, self.kv_heads, self.head_dim = decoders.cache_spec(self.config)
        self._files: dict[str, pathlib.Path] = {}
        params = dict(self.model.named_parameters())
        embed = self.model.get_input_embeddings().weight
        tied = any(p is embed for n, p in params.items() if "lm_head" in n) or getattr(
            self.config, "tie_word_embeddings", False)
        total = sum(p.numel() for p in params.values())
        self.params = total
        self.embed_params = embed.numel()
        # weights a decode step reads: all but the input embedding table (gathered by row), which a tied
        # lm_head reads in full anyway
        self.step_weight_elems = total if tied else total - embed.numel()
        self.flop_params = total - (0 if tied else embed.numel())  # the GEMM weights (lm_head included)
        # past protobuf's 2 GiB a model file keeps its weights in a data file beside it
        self.big = total * ELEM_BYTES[dtype] > 2**31

    def export(self, kind: str) -> pathlib.Path:
        """kind: "default" (dynamo, default opset), "opset23" (dynamo, opset 23), "torchscript",
        "torchscript_fp32" (the same weights widened to float32: what ORT's optimizer converts to fp16 itself).
        An export a finished earlier run left in the work directory is reused (build() is seeded)."""
        if kind not in self._files:
            path = self.work / f"{self.name}.{self.dtype}.{kind}.onnx"
            if not done(path):
                exporter = "torchscript" if kind.startswith("torchscript") else "dynamo"
                module = self.float32() if kind == "torchscript_fp32" else self.model
                decoders.export(module, path, exporter=exporter, cache=True,
                                opset=23 if kind == "opset23" else None)
                mark_done(path)
            self._files[kind] = path
        return self._files[kind]

    def float32(self):
        """A float32 copy of the model on the CPU (the same, rounded, weights)."""
        import copy

        return copy.deepcopy(self.model).to("cpu").float()

    def positions(self) -> int:
        return decoders.max_positions(self.config)

    def feeds(self, phase: str, batch: int, n: int, seed: int = 0) -> dict:
        """numpy feeds: prefill (S = n, P = 0) or decode (S = 1, P = n)."""
        seq, past = (n, 0) if phase == "prefill" else (1, n)
        return decoders.sample_inputs(self.model, batch, seq, past, seed=seed)


# ---- ORT ---------------------------------------------------------------------------------------------
class OrtRuntime:
    name = "ort_stock"
    export_kind = "default"
    cuda_graph = False
    info = ""

    def available(self, m: Model) -> str | None:
        import onnxruntime as ort

        if m.device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider"
        if self.cuda_graph and m.device != "cuda":
            return "CUDA graphs need --device cuda"
        return None

    def model_file(self, m: Model) -> pathlib.Path:
        return m.export(self.export_kind)

    def session_options(self):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        return so

    def session(self, m: Model, path: pathlib.Path | None = None):
        import onnxruntime as ort

        path = path or self.model_file(m)
        providers = ["CPUExecutionProvider"]
        if m.device == "cuda":
            providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if self.cuda_graph else {})]
        return ort.InferenceSession(str(path), self.session_options(), providers=providers)

    def start(self, m: Model):
        self.sess = self.session(m)
        self.graph_ids = 0

    def runner(self, m: Model, feeds: dict):
        return self._bind(m, feeds)

    def _bind(self, m: Model, feeds: dict, over: dict[str, str] | None = None):
        """A runner of self.sess over `feeds`, IO-bound: with CUDA graphs (or `over`) every output into a buffer of
        its own, fixed for replays, else where ORT puts it. over: output -> input whose buffer the output is bound
        over (a sequence-first present over its past: the input's buffer then sized for the output, the input in
        its first elements). A cache tensor's layout is the model's metadata's (ops/kv_layout.seq_major_names)."""
        import onnxruntime as ort

        from ..ops.kv_layout import session_seq_major_names

        over = over or {}
        device = "cuda" if m.device == "cuda" else "cpu"
        (b, s), total = feeds["input_ids"].shape, feeds["attention_mask"].shape[1]
        relaid = session_seq_major_names(self.sess)
        np_t = np.float16 if m.dtype == "float16" else np.float32

        def out_shape(name):
            if name == "logits":
                return [b, s, m.config.vocab_size]
            return [total, b, m.kv_heads, m.head_dim] if name in relaid else [b, m.kv_heads, total, m.head_dim]

        io, keep, buffers = self.sess.io_binding(), [], {}
        outputs_of = {i: o for o, i in over.items()}
        for inp in self.sess.get_inputs():
            value = feeds[inp.name]
            if inp.name in outputs_of:
                full = np.zeros(out_shape(outputs_of[inp.name]), value.dtype)
                full.reshape(-1)[:value.size] = value.reshape(-1)
                buffers[inp.name] = buf = ort.OrtValue.ortvalue_from_numpy(full, device, 0)
                io.bind_input(inp.name, device, 0, value.dtype, list(value.shape), buf.data_ptr())
            else:
                buf = ort.OrtValue.ortvalue_from_numpy(value, device, 0)
                io.bind_ortvalue_input(inp.name, buf)
            keep.append(buf)
        ro = ort.RunOptions()
        for out in self.sess.get_outputs():
            if out.name in over:
                io.bind_output(out.name, device, 0, np_t, out_shape(out.name), buffers[over[out.name]].data_ptr())
            elif self.cuda_graph:  # fixed output buffers, one graph per shape
                value = ort.OrtValue.ortvalue_from_shape_and_type(out_shape(out.name), np_t, device, 0)
                keep.append(value)
                io.bind_ortvalue_output(out.name, value)
            else:
                io.bind_output(out.name, device)
        if self.cuda_graph:
            self.graph_ids += 1
            ro.add_run_config_entry("gpu_graph_id", str(self.graph_ids))
        return self._bound_run(io, ro, keep)

    def _bound_run(self, io, ro, keep: list):
        """The runner of a session bound by `io` (run options `ro`; `keep`: the buffers it must outlive), with
        .logits(): one run, then the first output (the logits) on the host."""

        def run():
            self.sess.run_with_iobinding(io, ro)

        def logits():
            run()
            return io.get_outputs()[0].numpy()

        run.keep, run.logits = keep, logits
        return run

    def stop(self):
        self.sess = None


class OrtOpset23(OrtRuntime):
    name, export_kind = "ort_opset23", "opset23"


class OrtOpset23CudaGraph(OrtOpset23):
    name, cuda_graph = "ort_opset23_cuda_graph", True


class _Rewritten(OrtRuntime):
    """A runtime whose file is a rewrite of an export, made once."""

    file_name = None  # the rewrite's name in the work directory (default: the runtime's)

    def rewrite(self, m: Model, out: pathlib.Path) -> None:
        raise NotImplementedError

    def key(self) -> str:
        """The rewrite's name in the work directory: what must differ between two rewrites of one export."""
        return self.file_name or self.name

    def model_file(self, m):
        out = m.work / f"{m.name}.{m.dtype}.{self.key()}.onnx"
        if done(out):  # made by an earlier run in this work directory
            self.info = out.with_name(out.name + ".done").read_text()
        else:
            self.rewrite(m, out)
            mark_done(out, self.info)
        return out


class OnnxscriptFusions(_Rewritten):
    name = "onnxscript_fusions"

    def rewrite(self, m, out):
        import onnx_ir as ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        optimized, counts = optimize_for_ort(ir.load(str(m.export("default"))))
        self.info = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if v) or "nothing fused"
        ir.save(optimized, str(out), external_data=out.name + ".data" if m.big else None)


class OrtOptimizer(_Rewritten):
    """ORT's transformers optimizer, for GPT-2 (its model_type "gpt2") on the torchscript export."""

    name = "ort_optimizer"

    def available(self, m):
        if m.config.model_type != "gpt2":
            return f"ORT's transformers optimizer fuses GPT-2 decoders; not run on {m.config.model_type}"
        return super().available(m)

    def rewrite(self, m, out):
        from onnxruntime.transformers.optimizer import optimize_model

        # its documented fp16 flow: fuse the float32 export, then convert (fusing an fp16 export leaves a
        # LayerNormalization with float and float16 inputs that ORT refuses to load)
        opt = optimize_model(str(m.export("torchscript_fp32")), model_type="gpt2", num_heads=m.config.n_head,
                             hidden_size=m.config.n_embd, use_gpu=m.device == "cuda")
        if m.dtype == "float16":
            opt.convert_float_to_float16(keep_io_types=False)
        self.info = ", ".join(f"{k} {v}" for k, v in sorted(opt.get_fused_operator_statistics().items()) if v)
        opt.save_model_to_file(str(out))


class OrtTriton(_Rewritten):
    name = "ort_triton"
    file_name = "ort_triton"  # one fused model for every ort_triton runtime (of one set of rules)
    library = None  # the default library
    disable: tuple[str, ...] = ()  # rules left out: an ablation's twin of a runtime
    enable: tuple[str, ...] = ()  # rules off by default put in: a candidate's twin
    kv_cache = "heads-first"  # the fused model's cache layout (graph_rewrites.optimize's kv_cache)

    def available(self, m):
        reason = super().available(m)
        return reason if reason or m.device != "cuda" else library_reason()

    def key(self):
        """The file name and a digest of the rules this runtime runs and of graph_rewrites' source: a work
        directory kept between runs never hands back a model fused by other rules (a default turned on since, a
        rule changed)."""
        import hashlib

        import graph_rewrites
        from graph_rewrites.registry import select

        digest = hashlib.sha1(" ".join([r.name for r in select(disable=list(self.disable), enable=list(self.enable))]
                                       + [self.kv_cache]).encode())
        for src in sorted(pathlib.Path(graph_rewrites.__file__).parent.glob("*.py")):
            digest.update(src.read_bytes())
        return f"{self.file_name}-{digest.hexdigest()[:10]}"

    def rewrite(self, m, out):
        import graph_rewrites

        from ..cli import save_atomic

        model, report = graph_rewrites.optimize(str(m.export("default")), report=True,
                                                disable=list(self.disable), enable=list(self.enable),
                                                kv_cache=self.kv_cache)
        self.info = ", ".join(f"{r.name} {r.matched}" for r in report.rules.values() if r.matched)
        save_atomic(model, out, external=m.big)

    def session(self, m, path=None):
        from ..runtime import make_session

        providers = ["CPUExecutionProvider"]
        if m.device == "cuda":
            providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if self.cuda_graph else {})]
        return make_session(path or self.model_file(m), providers=providers, session_options=self.session_options(),
                            library=self.library)


class _PerShape:
    """A runtime on its model specialised for each shape (graph_rewrites/static_shapes.py, what `optimize
    --static-shapes` does): every shape computation folded, so every node can run on the CUDA EP and ORT can
    capture a CUDA graph. One session per shape, made when the shape comes. Mixed into ORT's own runtimes too:
    ORT refuses to capture the dynamic cache exports, and the same specialisation gives it its CUDA graphs."""

    def start(self, m):
        self.path = self.model_file(m)  # the runtime's model, made once
        self.sess, self.graph_ids = None, 0

    def specialized(self, m, feeds) -> pathlib.Path:
        """The model specialised for the feeds' shapes, made once per work directory: every runtime on the same
        model (default or tuned library, with or without CUDA graphs) reads the same file, and two of them alive
        side by side (bench.ab) never write over a file the other's session loaded. Remade when the model is not
        the one it was made from. A model whose weights are in a data file keeps them there: the specialised
        file references the same data file (the weights are not copied for every shape)."""
        import onnx_ir as ir

        from graph_rewrites.static_shapes import specialize

        (b, s), n = feeds["input_ids"].shape, feeds["attention_mask"].shape[1]
        out = m.work / f"{self.path.stem}_static.{b}x{s}x{n}.onnx"
        stamp = str(self.path.stat().st_mtime_ns)
        if done(out) and out.with_name(out.name + ".done").read_text() == stamp:
            return out
        shapes = {k: list(v.shape) for k, v in feeds.items()}
        model = self.load_for(shapes)  # a fresh copy: specialize works in place
        left = specialize(model, shapes)
        if left:
            raise RuntimeError(f"{len(left)} shape node(s) left after specialisation: {', '.join(left[:4])}")
        ir.save(model, str(out))  # external weights stay references to the model's data file, beside it
        del model
        mark_done(out, stamp)
        return out

    def load_for(self, shapes: dict):
        import onnx_ir as ir

        return ir.load(str(self.path))

    def runner(self, m, feeds):
        out = self.specialized(m, feeds)
        self.sess = None  # one shape's session at a time
        self.sess = self.session(m, out)
        return super().runner(m, feeds)


class OrtOpset23Static(_PerShape, OrtOpset23):
    """ORT on the opset-23 export (its Attention, RMSNormalization, RotaryEmbedding) specialised per shape."""

    name = "ort_opset23_static"


class OrtOpset23StaticCudaGraph(OrtOpset23Static):
    """The same with ORT's CUDA graphs: FACTS.md's best ORT configuration, which ORT refuses to capture on the
    dynamic cache export (ort_opset23_cuda_graph's rows say why)."""

    name, cuda_graph = "ort_opset23_static_cuda_graph", True


class OrtOptimizerStatic(_PerShape, OrtOptimizer):
    """ORT's transformers optimizer (GPT-2) on its model specialised per shape."""

    name = "ort_optimizer_static"

    def load_for(self, shapes):
        """The optimizer's model with every value's shape inferred for these input shapes by ORT's own symbolic
        shape inference, which knows its contrib ops (SkipLayerNormalization, FastGelu): the folder cannot see
        through them, and the Shape nodes read from their outputs would stay."""
        import onnx
        import onnx_ir as ir
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        proto = onnx.load(str(self.path))
        for value in proto.graph.input:
            if value.name in shapes:
                for dim, size in zip(value.type.tensor_type.shape.dim, shapes[value.name]):
                    dim.Clear()
                    dim.dim_value = size
        return ir.from_proto(SymbolicShapeInference.infer_shapes(proto, auto_merge=True))


class OrtOptimizerStaticCudaGraph(OrtOptimizerStatic):
    name, cuda_graph = "ort_optimizer_static_cuda_graph", True


class OrtTritonStatic(_PerShape, OrtTriton):
    """ort_triton on the fused model specialised for each shape (see _PerShape)."""

    name = "ort_triton_static"


class OrtTritonCudaGraph(OrtTritonStatic):
    name, cuda_graph = "ort_triton_cuda_graph", True


class OrtTritonUnpackedStatic(OrtTritonStatic):
    """ort_triton_static without pack_projections (Q, K and V as three MatMuls): what packing buys, beside it
    in one run (bench.ab; opt-in, as is its CUDA-graph twin)."""

    name, file_name, disable = "ort_triton_unpacked_static", "ort_triton_unpacked", ("pack_projections",)


class OrtTritonUnpackedCudaGraph(OrtTritonUnpackedStatic):
    name, cuda_graph = "ort_triton_unpacked_cuda_graph", True


class OrtTritonNoQkvRotaryCacheStatic(OrtTritonStatic):
    """ort_triton_static without qkv_rotary_cache: each layer's Split of the packed Q/K/V, its two rotaries, V's
    Transpose and the two cache Concats as six launches, not one QKVRotaryCache. Beside ort_triton_static
    (bench.ab) it measures what the fusion buys (the past's copy into present stays in both). Opt-in, as is its
    CUDA-graph twin."""

    name, file_name, disable = "ort_triton_no_qrc_static", "ort_triton_no_qrc", ("qkv_rotary_cache",)


class OrtTritonNoQkvRotaryCacheCudaGraph(OrtTritonNoQkvRotaryCacheStatic):
    name, cuda_graph = "ort_triton_no_qrc_cuda_graph", True


class OrtTritonPaddedWeightStatic(OrtTritonStatic):
    """ort_triton_static with padded_weight (off by default until timed): an unaligned lm_head (GPT-2's) on its
    weight padded to 16-byte rows, the logits sliced back. Beside ort_triton_static (bench.ab) it measures what
    the rule buys. Opt-in, as is its CUDA-graph twin."""

    name, file_name, enable = "ort_triton_pw_static", "ort_triton_pw", ("padded_weight",)


class OrtTritonPaddedWeightCudaGraph(OrtTritonPaddedWeightStatic):
    name, cuda_graph = "ort_triton_pw_cuda_graph", True


class OrtTritonNoQkvCacheStatic(OrtTritonStatic):
    """ort_triton_static without qkv_cache: GPT-2's bias Add, Split, head Transposes and cache Concats of a layer
    as ORT's ops, not one QKVCache. Beside ort_triton_static (bench.ab) it measures what the fusion buys. Opt-in,
    as is its CUDA-graph twin."""

    name, file_name, disable = "ort_triton_no_qkvc_static", "ort_triton_no_qkvc", ("qkv_cache",)


class OrtTritonNoQkvCacheCudaGraph(OrtTritonNoQkvCacheStatic):
    name, cuda_graph = "ort_triton_no_qkvc_cuda_graph", True


class OrtTritonLinearStatic(OrtTritonStatic):
    """ort_triton_static with linear (off by default: it loses on encoders): every MatMul by a constant weight as
    Linear, a Triton GEMV or skinny product up to 16 rows, cuBLAS beyond. Beside ort_triton_static (bench.ab) it
    measures what the rule buys. Opt-in, as is its CUDA-graph twin."""

    name, file_name, enable = "ort_triton_linear_static", "ort_triton_linear", ("linear",)


class OrtTritonLinearCudaGraph(OrtTritonLinearStatic):
    name, cuda_graph = "ort_triton_linear_cuda_graph", True


class OrtTritonSeqMajorStatic(OrtTritonStatic):
    """ort_triton_static with the cache sequence first (`optimize --kv-cache seq-major`, graph_rewrites/kv_layout.py):
    each present bound over its past, one buffer a cache tensor, so a decode step writes its new rows and copies
    nothing. Beside ort_triton_static (bench.ab) it measures what the copy cost. Opt-in, as is its CUDA-graph twin."""

    name, file_name, kv_cache = "ort_triton_seq_static", "ort_triton_seq", "seq-major"

    def runner(self, m, feeds):
        from ..ops.kv_layout import TO_SEQ

        pasts = decoders.input_names(m.config)[2:]
        feeds = {k: np.ascontiguousarray(v.transpose(TO_SEQ)) if k in pasts else v for k, v in feeds.items()}
        self.sess = None  # one shape's session at a time
        self.sess = self.session(m, self.specialized(m, feeds))
        return self._bind(m, feeds, over=dict(zip(decoders.output_names(m.config)[1:], pasts)))


class OrtTritonSeqMajorCudaGraph(OrtTritonSeqMajorStatic):
    name, cuda_graph = "ort_triton_seq_cuda_graph", True


class _TunedLibrary:
    """The same fused model with the library of a tuning table ($ORT_TRITON_TUNED_LIBRARY, built with
    `ort-triton build --tuning`): what tuning buys, beside the default library in one run (opt-in)."""

    def available(self, m):
        reason = super().available(m) or (None if m.device == "cuda" else "the tuned library runs on CUDA only")
        reason = reason or tuned_library_reason()
        if not reason:
            self.library = os.environ[TUNED_LIBRARY_ENV]
        return reason


class OrtTritonTuned(_TunedLibrary, OrtTriton):
    name = "ort_triton_tuned"


class OrtTritonTunedCudaGraph(_TunedLibrary, OrtTritonCudaGraph):
    name = "ort_triton_tuned_cuda_graph"


# ---- PyTorch -----------------------------------------------------------------------------------------
class TorchEager:
    name = "torch_eager"
    info = "transformers, attn_implementation=sdpa, DynamicCache"

    def available(self, m):
        return None

    def start(self, m):
        self.module = decoders.wrap(m.model.to(m.device), cache=True)

    def runner(self, m, feeds):
        import torch

        args = [torch.from_numpy(v).to(m.device) for v in feeds.values()]

        def run():
            with torch.no_grad():
                return self.module(*args)

        run.logits = lambda: run()[0].float().cpu().numpy()
        return run

    def stop(self):
        self.module = None


class TorchCompile(TorchEager):
    """torch.compile of the same module, one compile per shape (dynamic=False); not in the default set: a 1B
    model compiles for minutes per shape."""

    name, mode = "torch_compile", "default"
    info = "torch.compile(mode=default, dynamic=False) of the transformers module"

    def start(self, m):
        import torch

        # one compile per shape: past dynamo's default of 8 recompiles it would run eager without saying so
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.module = torch.compile(decoders.wrap(m.model.to(m.device), cache=True), mode=self.mode, dynamic=False)


class TorchCompileCudaGraph(TorchCompile):
    name, mode = "torch_compile_cuda_graph", "reduce-overhead"
    info = "torch.compile(mode=reduce-overhead: CUDA graphs, dynamic=False) of the transformers module"


ALL = {rt.name: rt for rt in (OrtRuntime, OrtOpset23, OrtOpset23CudaGraph, OnnxscriptFusions, OrtOptimizer,
                              OrtOpset23Static, OrtOpset23StaticCudaGraph, OrtOptimizerStatic,
                              OrtOptimizerStaticCudaGraph,
                              OrtTriton, OrtTritonStatic, OrtTritonCudaGraph, TorchEager, TorchCompile,
                              TorchCompileCudaGraph, OrtTritonTuned, OrtTritonTunedCudaGraph,
                              OrtTritonUnpackedStatic, OrtTritonUnpackedCudaGraph, OrtTritonNoQkvRotaryCacheStatic,
                              OrtTritonNoQkvRotaryCacheCudaGraph, OrtTritonPaddedWeightStatic,
                              OrtTritonPaddedWeightCudaGraph, OrtTritonNoQkvCacheStatic, OrtTritonNoQkvCacheCudaGraph,
                              OrtTritonLinearStatic, OrtTritonLinearCudaGraph, OrtTritonSeqMajorStatic,
                              OrtTritonSeqMajorCudaGraph)}


def runtime(name: str) -> OrtRuntime:
    """The runtime a name gives: one of ALL, or an ort_triton runtime with rules that are off by default put in
    (+RULE) or rules that are on left out (-RULE), `BASE+RULE-RULE...` (e.g. ort_triton_cuda_graph+add_rms_norm_swiglu,
    ort_triton_cuda_graph-causal_attention): a candidate's or an ablation's twin measured beside its base (bench.ab)
    with no class written for it. Raises ValueError naming what is known."""
    from graph_rewrites.registry import BY_NAME

    base = re.match(r"[^+-]*", name).group(0)
    changes = re.findall(r"([+-])([^+-]*)", name[len(base):])
    if base not in ALL:
        raise ValueError(f"unknown runtime {base!r}; known: {', '.join(ALL)}")
    cls = ALL[base]
    if not changes:
        return cls()
    unknown = [r for _, r in changes if r not in BY_NAME]
    if unknown:
        raise ValueError(f"{name}: unknown rule(s) {unknown}; known: {', '.join(BY_NAME)}")
    if not issubclass(cls, OrtTriton):
        raise ValueError(f"{name}: +RULE and -RULE go after an ort_triton runtime, not {base}")
    put_in = tuple(r for sign, r in changes if sign == "+")
    left_out = tuple(r for sign, r in changes if sign == "-")
    twin = type(cls.__name__ + "Twin", (cls,), dict(name=name, enable=(*cls.enable, *put_in),
                                                    disable=(*cls.disable, *left_out),
                                                    file_name=cls.file_name + name[len(base):]))
    return twin()


# ---- the loop -----------------------------------------------------------------------------------------
def _counts(m: Model, phase: str, batch: int, n: int, ms: float) -> dict:
    e = ELEM_BYTES[m.dtype]
    if phase == "decode":
        cache = 2 * m.layers * batch * m.kv_heads * n * m.head_dim * e
        moved = m.step_weight_elems * e + cache + batch * m.config.hidden_size * e
        gbs = moved / ms / 1e6
        # the Concat cache's copy: the past read and written again into present (bench/results, session 30)
        copied = 2 * cache
        return dict(bytes_min=moved, gb_s=gbs, ceiling_fraction=gbs / CEILING_GBS, tokens_per_s=batch / ms * 1e3,
                    bytes_cache_copy=copied, ceiling_fraction_with_copy=(moved + copied) / ms / 1e6 / CEILING_GBS)
    heads = m.config.num_attention_heads
    flops = 2 * m.flop_params * batch * n + 2 * 2 * m.layers * batch * heads * n * n / 2 * m.head_dim
    return dict(flops=flops, tflop_s=flops / ms / 1e9, tokens_per_s=batch * n / ms * 1e3)


def _shape_row(phase: str, b: int, n: int) -> dict:
    return dict(phase=phase, batch=b, seq=n if phase == "prefill" else 1, past=0 if phase == "prefill" else n)


def _too_long(m: Model, phase: str, n: int) -> str | None:
    total = n if phase == "prefill" else n + 1
    if total > m.positions():
        return f"P+S = {total} positions > the model's {m.positions()} (its position table)"
    return None


def _references(m: Model, shapes) -> dict:
    """Last-token logits [B, vocab] of the float32 module for every shape, on the bench's device."""
    import torch

    module = decoders.wrap(m.float32().to(m.device), cache=True)
    out = {}
    with torch.no_grad():
        for phase, b, n in shapes:
            feeds = m.feeds(phase, b, n)
            args = [torch.from_numpy(v).to(m.device) for v in feeds.values()]
            args = [a.float() if a.is_floating_point() else a for a in args]
            out[(phase, b, n)] = module(*args)[0][:, -1].float().cpu().numpy()
    del module
    return out


def _accuracy(logits: np.ndarray, ref: np.ndarray) -> dict:
    diff = float(np.abs(logits - ref).max())
    return dict(diff_against="torch_float32", max_abs_diff_last_logits=diff,
                rel_diff_last_logits=diff / float(np.abs(ref).max()),
                top1_agreement=float((logits.argmax(-1) == ref.argmax(-1)).mean()))


def bench(model: str, prefill, decode, runtimes, *, dtype="float16", device="cuda", warmup=5, iters=30,
          log=print, save=None, work=None, profile=False) -> list[dict]:
    """save(rows) is called after every row and runtime: a run cut short keeps what it measured. work: a directory
    whose exports and fused models are kept and reused by the next run (default: a temporary one).
    profile: also trace each timed shape's kernels (CUPTI, after the timing) into the row's `gpu_profile`."""
    gpu, versions = environment(device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ort_triton_decoder_") as tmp:
        t0 = time.time()
        if work:
            pathlib.Path(work).mkdir(parents=True, exist_ok=True)
        m = Model(model, dtype, device, pathlib.Path(work or tmp))
        log(f"{model}: {m.params / 1e6:.1f} M parameters, {m.layers} layers, {m.kv_heads} kv heads x "
            f"{m.head_dim}, {dtype} ({time.time() - t0:.0f} s)")
        shapes = [("prefill", b, n) for b, n in prefill] + [("decode", b, n) for b, n in decode]
        too_long = {s: _too_long(m, s[0], s[2]) for s in shapes}
        t0 = time.time()
        reference = _references(m, [s for s in shapes if not too_long[s]])
        _release(device)
        log(f"float32 reference logits: {len(reference)} shape(s) ({time.time() - t0:.0f} s)")
        clock = Clock(device)
        for name in runtimes:
            rt = runtime(name)
            base = dict(model=model, dtype=dtype, runtime=name, gpu=gpu, versions=versions,
                        export={"exporter": "torchscript" if name.startswith("ort_optimizer") else "dynamo",
                                "opset": 23 if "opset23" in name else None, "attn_implementation": "sdpa"})
            reason = rt.available(m)
            if reason:
                log(f"{name}: skipped ({reason})")
                rows += [dict(base, **_shape_row(*s), status="skipped", error=reason) for s in shapes]
                continue
            t0 = time.time()
            try:
                rt.start(m)
            except Exception as e:  # noqa: BLE001  (a runtime that fails is a row, not the end of the run)
                log(f"{name}: failed to start: {_short(e)}")
                rows += [dict(base, **_shape_row(*s), status="error", error=_short(e)) for s in shapes]
                continue
            log(f"{name}: ready in {time.time() - t0:.0f} s; {rt.info}")
            for phase, b, n in shapes:
                row = dict(base, **_shape_row(phase, b, n), info=rt.info)
                if too_long[(phase, b, n)]:
                    row.update(status="skipped", error=too_long[(phase, b, n)])
                    rows.append(row)
                    log(_line(row))
                    continue
                run = None
                try:
                    run = rt.runner(m, m.feeds(phase, b, n))
                    for _ in range(warmup):
                        run()
                    times = [clock.time(run) for _ in range(iters)]
                    logits = run.logits()[:, -1].astype(np.float32)
                    p50, p90, p99 = (float(v) for v in np.percentile(times, [50, 90, 99]))
                    row.update(status="ok", p50_ms=p50, p90_ms=p90, p99_ms=p99, **_counts(m, phase, b, n, p50),
                               **_accuracy(logits, reference[(phase, b, n)]))
                    if profile:
                        row["gpu_profile"] = trace(run, 5)
                except Exception as e:  # noqa: BLE001
                    row.update(status="error", error=_short(e))
                del run
                rows.append(row)
                log(_line(row))
                if save:  # after every row: a run cut short (a device call's time limit) keeps what it measured
                    save(rows)
                if "gpu_profile" in row:
                    log("\n".join("      " + line for line in summary_lines(row["gpu_profile"])))
            rt.stop()
            _release(device)
            if save:
                save(rows)
    return rows


def _line(r: dict) -> str:
    shape = f"{r['phase']} {r['batch']}x{r['seq'] if r['phase'] == 'prefill' else r['past']}"
    if r["status"] != "ok":
        return f"  {shape:18} {r['runtime']:24} {r['status']}: {r.get('error', '')}"
    extra = (f"{r['gb_s']:7.0f} GB/s ({100 * r['ceiling_fraction']:4.1f}%; "
             f"{100 * r.get('ceiling_fraction_with_copy', r['ceiling_fraction']):4.1f}% with the cache copy)"
             if r["phase"] == "decode"
             else f"{r['tflop_s']:6.1f} TFLOP/s")
    diff = (f"  vs fp32: |d| {r['max_abs_diff_last_logits']:.2e} ({100 * r['rel_diff_last_logits']:.2f}% of max), "
            f"top-1 {100 * r['top1_agreement']:.0f}%" if "max_abs_diff_last_logits" in r else "")
    return f"  {shape:18} {r['runtime']:24} p50 {r['p50_ms']:9.3f} ms  {extra}{diff}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b", help=f"one of {', '.join(decoders.CONFIGS)}")
    p.add_argument("--prefill", default=PREFILL, help="BxS,... prompt shapes ('' for none)")
    p.add_argument("--decode", default=DECODE, help="BxP,... cache lengths ('' for none)")
    p.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"comma-separated from {', '.join(ALL)}; "
                   "an ort_triton runtime takes rules that are off by default as +RULE, and leaves rules out as -RULE: "
                   "ort_triton_cuda_graph+linear, ort_triton_cuda_graph-causal_attention")
    p.add_argument("--dtype", choices=tuple(ELEM_BYTES), default="float16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--work", help="keep the exports and fused models here and reuse them next time (a 1B model "
                   "takes minutes to export and fuse)")
    p.add_argument("--profile", action="store_true", help="also trace each shape's GPU kernels (CUPTI) into "
                   "the rows: where a step's time goes")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    for name in args.runtimes.split(","):
        try:
            runtime(name)
        except ValueError as e:
            p.error(str(e))
    command = "python -m ort_triton.bench.decoder " + " ".join(argv if argv is not None else sys.argv[1:])

    def save(rows):
        out = pathlib.Path(args.json)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps([dict(r, command=command) for r in rows], indent=1) + "\n")
        tmp.replace(out)

    bench(args.model, parse(args.prefill), parse(args.decode), args.runtimes.split(","), dtype=args.dtype,
          device=args.device, warmup=args.warmup, iters=args.iters, save=save, work=args.work,
          profile=args.profile)


if __name__ == "__main__":
    main()
