"""Benchmarks: scripts run on the GPU machine (see scripts/gpu_check.sh), never timed tests.

This package is also the Python API `ort_triton.bench(model, shapes=..., ...)`: once any module under it is
imported, Python binds the name `ort_triton.bench` to this package, over the function that
ort_triton/__init__.py exports lazily; so the package itself calls harness.bench.
"""

import sys
import types


class _Callable(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from .harness import bench

        return bench(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable  # as the data model documents ("Customizing module attribute access")
