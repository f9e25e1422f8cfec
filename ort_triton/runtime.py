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
    data = model if isinstance(model, (bytes, str)) else (
        str(model) if isinstance(model, pathlib.Path) else model.SerializeToString())
    return ort.InferenceSession(data, so, providers=providers)
