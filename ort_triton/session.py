"""A serving session over shape buckets: one static-shape model per bucket, IO binding on preallocated
buffers and, on the CUDA EP, one captured CUDA graph per bucket.

    sess = ort_triton.Session("model.ot.onnx", buckets=[(1, 128), (8, 128), (8, 512)])
    (hidden,) = sess.run({"input_ids": ids, "attention_mask": mask})     # numpy in, numpy out

A request is padded up to the smallest bucket that holds it and the outputs are cut back: along the batch
always (rows are independent), along other axes only when the model has an `attention_mask` input (padded
positions get mask 0, which is what keeps the valid positions' outputs unchanged in a transformer encoder).
Why buckets: a CUDA graph replays fixed shapes and addresses, and ORT refuses to capture a model with
shape subgraphs on the CPU, so each bucket's model is specialised (graph_rewrites/static_shapes.py) and
bound to its own buffers. Where capture is impossible (no CUDA EP, or ORT refuses the model) the session
runs without graphs and `fallback_reason` says why; `run` never silently changes results.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
import threading

import numpy as np
import onnx

MASK_INPUT = "attention_mask"
_INLINE_LIMIT = 1 << 30  # bytes of weights above which a bucket's model goes through a file


@dataclasses.dataclass
class _Bucket:
    dims: dict[str, list[int]]
    session: object
    binding: object
    inputs: dict[str, object]  # name -> OrtValue bound as that input
    outputs: list[object]  # OrtValues bound as the outputs, in model order
    lock: threading.Lock


def _np_type(elem_type: int):
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type)


def _dims(value_info) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value_info.type.tensor_type.shape.dim]


class Session:
    def __init__(self, model, buckets, *, providers=("CUDAExecutionProvider",), device_id: int = 0,
                 cuda_graph: bool = True, library=None, session_options=None):
        import onnxruntime as ort

        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(pathlib.Path(model)))
        self._proto = proto
        inits = {t.name for t in proto.graph.initializer}
        self.input_names = [i.name for i in proto.graph.input if i.name not in inits]
        self.output_names = [o.name for o in proto.graph.output]
        self._in_info = {i.name: i for i in proto.graph.input if i.name not in inits}
        self._out_dims = [_dims(o) for o in proto.graph.output]
        self._weight_bytes = sum(len(t.raw_data) for t in proto.graph.initializer)
        # padding is only undone where every output dim is known (a number, or a name an input dim shares)
        self._can_pad = MASK_INPUT in self.input_names and all(d is not None for ds in self._out_dims for d in ds)
        self.providers = [p if isinstance(p, tuple) else (p, {}) for p in providers]
        self.device = "cuda" if self.providers and self.providers[0][0] == "CUDAExecutionProvider" else "cpu"
        self.device_id = device_id
        self._library = library
        self._session_options = session_options
        self.fallback_reason: str | None = None
        self.cuda_graph = cuda_graph and self.device == "cuda"
        if cuda_graph and self.device != "cuda":
            self.fallback_reason = f"no CUDA graphs on {self.providers[0][0] if self.providers else 'no provider'}"
        if self.device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise RuntimeError(f"CUDAExecutionProvider is not available in onnxruntime {ort.__version__}: install "
                               "onnxruntime-gpu, or pass providers=['CPUExecutionProvider']")
        self.buckets = [self._make_bucket(self._bucket_dims(b)) for b in buckets]
        if not self.buckets:
            raise ValueError("Session needs at least one bucket, e.g. buckets=[(1, 128)]")

    # ---- buckets -------------------------------------------------------------------------------------
    def _bucket_dims(self, bucket) -> dict[str, list[int]]:
        """(B, S) is shorthand for every rank-2 input at [B, S]; else {input: dims} for every input."""
        if isinstance(bucket, dict):
            return {k: [int(d) for d in v] for k, v in bucket.items()}
        ranks = {n: len(_dims(i)) for n, i in self._in_info.items()}
        if any(r != len(bucket) for r in ranks.values()):
            raise ValueError(f"bucket {tuple(bucket)} is shorthand for inputs of rank {len(bucket)}, but the inputs "
                             f"have ranks {ranks}: give a dict {{input: dims}} per bucket")
        return {n: [int(d) for d in bucket] for n in self.input_names}

    def _options(self):
        import onnxruntime as ort

        if self._session_options is None:
            return ort.SessionOptions()
        so = ort.SessionOptions()  # a fresh copy per session: ORT ties registered libraries to one
        for attr in ("graph_optimization_level", "intra_op_num_threads", "inter_op_num_threads", "log_severity_level"):
            setattr(so, attr, getattr(self._session_options, attr))
        return so

    def _session(self, data: bytes | str, graph: bool):
        import onnxruntime as ort

        from . import runtime

        so = self._options()
        providers = [(name, dict(opts)) for name, opts in self.providers]
        if self.device == "cuda":
            runtime.register(so, self._library)
            providers[0][1].update(device_id=str(self.device_id))
            if graph:
                providers[0][1]["enable_cuda_graph"] = "1"
        return ort.InferenceSession(data, so, providers=providers)

    def _make_bucket(self, dims: dict[str, list[int]]) -> _Bucket:
        import onnx_ir as ir
        import onnxruntime as ort

        from graph_rewrites.static_shapes import specialize

        model = ir.serde.deserialize_model(self._proto)
        left = specialize(model, dims)
        if self._weight_bytes > _INLINE_LIMIT:  # past protobuf's 2 GiB: a file with external data
            self._tmp = getattr(self, "_tmp", None) or tempfile.TemporaryDirectory(prefix="ort_triton_session_")
            data = str(pathlib.Path(self._tmp.name) / f"bucket{len(getattr(self, 'buckets', []))}.onnx")
            ir.save(model, data, external_data=pathlib.Path(data).name + ".data")
        else:
            data = ir.serde.serialize_model(model).SerializeToString()
        del model
        sess = None
        if self.cuda_graph and left:
            self._fall_back(f"bucket {dims}: {len(left)} shape node(s) left on the CPU ({', '.join(left[:4])})")
        if self.cuda_graph:
            try:
                sess = self._session(data, graph=True)
            except Exception as e:  # noqa: BLE001  (ORT refuses capture at creation: say why, run without)
                self._fall_back(f"ORT refused CUDA-graph capture for bucket {dims}: {e}")
        sess = sess or self._session(data, graph=False)
        kind = "cuda" if self.device == "cuda" else "cpu"
        binding = sess.io_binding()
        inputs = {}
        for name in self.input_names:
            elem = self._in_info[name].type.tensor_type.elem_type
            inputs[name] = ort.OrtValue.ortvalue_from_shape_and_type(dims[name], _np_type(elem), kind,
                                                                      self.device_id)
            binding.bind_ortvalue_input(name, inputs[name])
        outputs = []
        for meta, info in zip(sess.get_outputs(), self._proto.graph.output):
            shape = meta.shape
            if not all(isinstance(d, int) for d in shape):
                raise ValueError(f"bucket {dims}: output {meta.name} has shape {shape} after specialisation; "
                                 "every output needs a static shape to be bound")
            outputs.append(ort.OrtValue.ortvalue_from_shape_and_type(
                shape, _np_type(info.type.tensor_type.elem_type), kind, self.device_id))
            binding.bind_ortvalue_output(meta.name, outputs[-1])
        return _Bucket(dims, sess, binding, inputs, outputs, threading.Lock())

    def _fall_back(self, reason: str) -> None:
        self.cuda_graph = False
        self.fallback_reason = reason

    def _pick(self, shapes: dict[str, tuple]) -> _Bucket:
        can_pad = self._can_pad
        for bucket in sorted(self.buckets, key=lambda b: sum(np.prod(d) for d in b.dims.values())):
            ok = True
            for name, shape in shapes.items():
                want = bucket.dims[name]
                if len(shape) != len(want) or any(s > w for s, w in zip(shape, want)):
                    ok = False
                elif not can_pad and list(shape[1:]) != want[1:]:
                    ok = False  # only the batch may be padded (no mask, or an output dim nobody names)
            if ok:
                return bucket
        have = ", ".join(str(b.dims) for b in self.buckets)
        raise ValueError(f"no bucket holds inputs of shapes {shapes}; buckets: {have}"
                         + ("" if can_pad else " (only the batch axis can be padded: the model has no "
                                                "attention_mask input or an output dim without a name)"))

    # ---- running -------------------------------------------------------------------------------------
    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        missing = set(self.input_names) - set(feeds)
        if missing:
            raise ValueError(f"missing input(s) {sorted(missing)}; the model takes {self.input_names}")
        arrays = {n: np.asarray(feeds[n]) for n in self.input_names}
        bucket = self._pick({n: a.shape for n, a in arrays.items()})
        sizes = {}  # the model's symbolic dims -> this request's sizes, to cut the outputs back
        for name, a in arrays.items():
            for sym, size in zip(_dims(self._in_info[name]), a.shape):
                if isinstance(sym, str):
                    sizes[sym] = size
        with bucket.lock:
            for name, a in arrays.items():
                want = bucket.dims[name]
                padded = np.zeros(want, dtype=a.dtype)  # ids 0, mask 0: padded positions are masked out
                padded[tuple(slice(0, s) for s in a.shape)] = a
                bucket.inputs[name].update_inplace(padded)
            bucket.session.run_with_iobinding(bucket.binding)
            results = [o.numpy() for o in bucket.outputs]
        return [r[tuple(slice(0, sizes[d]) if isinstance(d, str) and d in sizes else slice(None) for d in dims)]
                for r, dims in zip(results, self._out_dims)]
