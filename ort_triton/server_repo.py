"""`ort-triton export-server`: a Triton Inference Server model repository for its ONNX Runtime backend.

    REPO/NAME/config.pbtxt        platform onnxruntime_onnx, the inputs/outputs, batching, the library
    REPO/NAME/1/model.onnx        the (optimized) model, with its external data file if it has one
    REPO/NAME/libort_triton.so    the kernels, registered through model_operations.op_library_filename

The ORT backend hands op_library_filename to RegisterCustomOpsLibrary as it is (a dlopen path, resolved
against the server's working directory), so the config names the library by an absolute path: where the
repository will sit on the server (`server_repo`, e.g. /models in the usual container), by default where it
is written. CUDA graphs need fixed shapes and addresses: with cuda_graph=True every input must have a static
shape (`ort-triton optimize --static-shapes`), the model is served unbatched (max_batch_size 0) and the CUDA
EP option enable_cuda_graph is passed through the backend's "cuda" accelerator parameters. Otherwise the
first axis is the batch and requests are batched dynamically up to max_batch_size.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import onnx

TRITON_TYPES = {
    onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.BFLOAT16: "TYPE_BF16", onnx.TensorProto.DOUBLE: "TYPE_FP64",
    onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.INT32: "TYPE_INT32", onnx.TensorProto.INT8: "TYPE_INT8",
    onnx.TensorProto.UINT8: "TYPE_UINT8", onnx.TensorProto.BOOL: "TYPE_BOOL",
}


def _dims(value_info) -> list[int]:
    return [d.dim_value if d.HasField("dim_value") else -1 for d in value_info.type.tensor_type.shape.dim]


def _tensor_entries(kind: str, values, batched: bool) -> list[str]:
    out = []
    for v in values:
        elem = v.type.tensor_type.elem_type
        if elem not in TRITON_TYPES:
            raise ValueError(f"{kind} {v.name}: element type {onnx.TensorProto.DataType.Name(elem)} has no Triton "
                             "type this exporter knows")
        dims = _dims(v)[1:] if batched else _dims(v)
        out.append(f'{kind} [\n  {{\n    name: "{v.name}"\n    data_type: {TRITON_TYPES[elem]}\n'
                   f"    dims: [ {', '.join(map(str, dims))} ]\n  }}\n]")
    return out


def config_text(model: onnx.ModelProto, name: str, library: str, *, max_batch_size: int = 8,
                cuda_graph: bool = False, instances: int = 1) -> str:
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if cuda_graph:
        dynamic = [f"{i.name} {_dims(i)}" for i in inputs if -1 in _dims(i)]
        if dynamic:
            raise ValueError(f"--cuda-graph needs static input shapes, these are dynamic: {', '.join(dynamic)}; "
                             "specialise the model first: ort-triton optimize IN -o OUT --static-shapes NAME=DIMS,...")
        max_batch_size = 0
    batched = max_batch_size > 0
    if batched:
        fixed = [v.name for v in [*inputs, *model.graph.output] if not _dims(v) or _dims(v)[0] != -1]
        if fixed:
            raise ValueError(f"batching (max_batch_size {max_batch_size}) needs a dynamic first axis on every input "
                             f"and output; not on: {', '.join(fixed)}. Pass --max-batch-size 0 to serve unbatched")
    lines = [f'name: "{name}"', 'platform: "onnxruntime_onnx"', f"max_batch_size: {max_batch_size}"]
    lines += _tensor_entries("input", inputs, batched)
    lines += _tensor_entries("output", model.graph.output, batched)
    lines.append(f"instance_group [\n  {{\n    count: {instances}\n    kind: KIND_GPU\n  }}\n]")
    if batched:
        lines.append("dynamic_batching { }")
    lines.append(f'model_operations {{\n  op_library_filename: "{library}"\n}}')
    params = '\n        parameters { key: "enable_cuda_graph" value: "1" }' if cuda_graph else ""
    lines.append('optimization {\n  execution_accelerators {\n    gpu_execution_accelerator: [\n      {\n'
                 f'        name: "cuda"{params}\n      }}\n    ]\n  }}\n}}')
    return "\n".join(lines) + "\n"


def export_server(model_path, out: str | pathlib.Path, *, name: str | None = None, library=None,
                  server_repo: str | None = None, max_batch_size: int = 8, cuda_graph: bool = False,
                  instances: int = 1, force: bool = False) -> pathlib.Path:
    """Write REPO/NAME (see the module docstring) atomically; returns its path."""
    from .runtime import get_library_path

    src = pathlib.Path(model_path)
    model = onnx.load(str(src), load_external_data=False)
    name = name or src.stem.split(".")[0]
    repo = pathlib.Path(out)
    final = repo / name
    if final.exists() and not force:
        raise FileExistsError(f"{final} exists; pass --force to replace it")
    lib = pathlib.Path(library) if library else get_library_path()
    if not lib.is_file():
        raise FileNotFoundError(f"library {lib} not found; build it with `ort-triton build`")
    where = f"{server_repo.rstrip('/')}/{name}" if server_repo else str(final.resolve())
    text = config_text(model, name, f"{where}/libort_triton.so", max_batch_size=max_batch_size,
                       cuda_graph=cuda_graph, instances=instances)
    data = sorted({e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"})
    repo.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.", dir=repo))
    try:
        (tmp / "1").mkdir()
        shutil.copy2(src, tmp / "1" / "model.onnx")
        for f in data:  # external data sits beside the model, under the name the model records
            shutil.copy2(src.parent / f, tmp / "1" / f)
        shutil.copy2(lib, tmp / "libort_triton.so")
        (tmp / "config.pbtxt").write_text(text)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
