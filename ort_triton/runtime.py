"""Serving helpers: find the native library, register it, make sessions that use it only where it can run.

A CPU session with the library registered fails to create (its kernels are CUDA-only), while a rewritten
model runs anywhere through its function bodies; so `make_session` registers the library only when the
CUDA execution provider is requested.
"""

from __future__ import annotations

import pathlib

from .paths import library_candidates


class LibraryNotFound(FileNotFoundError):
    pass


def get_library_path() -> pathlib.Path:
    """Path of libort_triton.so ($ORT_TRITON_LIBRARY, the package, the cache, in that order)."""
    for cand in library_candidates():
        if cand.is_file():
            return cand
    looked = ", ".join(str(c) for c in library_candidates())
    raise LibraryNotFound(f"libort_triton.so not found (looked in {looked}). Build it with "
                          "`ort-triton build` (needs `pip install ort-triton[build]`, no GPU needed) or set "
                          "ORT_TRITON_LIBRARY.")


def launch_count(library: str | pathlib.Path | None = None) -> int:
    """Kernels the library has launched in this process (all sessions): proves that a node ran its
    Triton kernel rather than its function body. The library is the one ORT loaded (same path)."""
    import ctypes

    fn = ctypes.CDLL(str(library or get_library_path())).ort_triton_launches
    fn.restype = ctypes.c_long
    return fn()


def register(session_options, library: str | pathlib.Path | None = None) -> pathlib.Path:
    """Register the ort_triton custom ops into `session_options` (only for sessions on the CUDA EP)."""
    path = pathlib.Path(library) if library else get_library_path()
    session_options.register_custom_ops_library(str(path))
    return path


PROTO_LIMIT = 2**31 - 2**26  # protobuf's 2 GiB, less headroom for the graph itself


def past_proto_limit(model) -> bool:
    """Whether an onnx.ModelProto is too big to serialise as one protobuf. Past 2 GiB, protobuf's
    ByteSize itself raises (EncodeError: "Failed to serialize proto"), which says the same."""
    from google.protobuf.message import EncodeError

    try:
        return model.ByteSize() > PROTO_LIMIT
    except EncodeError:
        return True


def inference_session(model, session_options=None, providers=("CPUExecutionProvider",)):
    """ort.InferenceSession from a path, bytes or an onnx.ModelProto of any size: a ModelProto past
    protobuf's 2 GiB cannot be handed over as bytes, so it is written to a temporary file with its weights
    in a data file beside it, which ORT has read by the time the session exists. That moves the model's
    tensors out to the file (the caller's proto is consumed), as onnx's external-data save does."""
    import tempfile

    import onnx
    import onnxruntime as ort

    if isinstance(model, (str, bytes, pathlib.Path)):
        return ort.InferenceSession(str(model) if isinstance(model, pathlib.Path) else model, session_options,
                                    providers=list(providers))
    if not past_proto_limit(model):
        return ort.InferenceSession(model.SerializeToString(), session_options, providers=list(providers))
    with tempfile.TemporaryDirectory(prefix="ort_triton_model_") as tmp:
        path = pathlib.Path(tmp) / "model.onnx"
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="model.onnx.data", size_threshold=1024)
        return ort.InferenceSession(str(path), session_options, providers=list(providers))


def _provider_name(p) -> str:
    return p[0] if isinstance(p, tuple) else p


def make_session(model, providers=("CUDAExecutionProvider", "CPUExecutionProvider"), session_options=None,
                 device_id: int | None = None, library=None):
    """An InferenceSession for a (rewritten) model. The library is registered iff the CUDA EP is the
    first provider; `device_id` picks the GPU for it."""
    import onnxruntime as ort

    so = session_options or ort.SessionOptions()
    providers = list(providers)
    if device_id is not None:
        providers = [("CUDAExecutionProvider", {"device_id": str(device_id)})
                     if _provider_name(p) == "CUDAExecutionProvider" else p for p in providers]
    if providers and _provider_name(providers[0]) == "CUDAExecutionProvider":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise RuntimeError("CUDAExecutionProvider is not available in this onnxruntime "
                               f"({ort.__version__}, {ort.get_available_providers()}): install onnxruntime-gpu, "
                               "or pass providers=['CPUExecutionProvider'] to run the function bodies on CPU")
        register(so, library)
    return inference_session(model, so, providers)
