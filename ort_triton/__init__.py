"""ort_triton: fused transformer ops for ONNX Runtime's CUDA EP, as Triton kernels compiled ahead of time.

    import ort_triton
    model = ort_triton.optimize("model.onnx")            # rewrite: fused ops with ONNX function bodies
    diffs, feeds = ort_triton.compare_models(a, b)       # same inputs, per-output errors
    rows = ort_triton.bench("model.onnx", shapes=[(8, 512)])  # runtimes side by side (GPU)
    so = onnxruntime.SessionOptions()
    ort_triton.register(so)                               # the native kernels, for CUDA sessions
    ort_triton.build_library(archs=[90])                  # (re)build the library: needs triton, no GPU
    sess = ort_triton.Session(model, buckets=[(1, 128)])  # static-shape buckets, IO binding, CUDA graphs

Importing this package loads neither Triton nor torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Session", "__version__", "bench", "build_library", "compare_models", "get_library_path", "launch_count",
           "make_session", "optimize", "register"]


def __getattr__(name):  # lazy: serving needs neither the rewriter nor the build
    if name in ("get_library_path", "register", "make_session", "launch_count"):
        from . import runtime

        return getattr(runtime, name)
    if name == "Session":
        from .session import Session

        return Session
    if name == "build_library":
        from .aot.build import build_library

        return build_library
    if name == "optimize":
        from graph_rewrites import optimize

        return optimize
    if name == "compare_models":
        from .compare import compare_models

        return compare_models
    if name == "bench":
        from .bench.harness import bench

        return bench
    raise AttributeError(name)
