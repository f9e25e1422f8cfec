"""Where ort_triton keeps its build cache and looks for the native library."""

from __future__ import annotations

import os
import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def cache_dir() -> pathlib.Path:
    """$ORT_TRITON_CACHE, else ~/.cache/ort_triton: compiled kernels and the fetched ORT header."""
    env = os.environ.get("ORT_TRITON_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "ort_triton"


def default_library_dir() -> pathlib.Path:
    """Where `ort-triton build` writes by default: inside the package when it is writable (a source
    checkout or a user install), else the cache directory."""
    pkg_lib = PACKAGE_DIR / "_lib"
    try:
        pkg_lib.mkdir(exist_ok=True)
        if os.access(pkg_lib, os.W_OK):
            return pkg_lib
    except OSError:
        pass
    return cache_dir() / "lib"


def library_candidates() -> list[pathlib.Path]:
    """Search order for libort_triton.so: $ORT_TRITON_LIBRARY, the package, the cache."""
    env = os.environ.get("ORT_TRITON_LIBRARY")
    found = [pathlib.Path(env)] if env else []
    return found + [PACKAGE_DIR / "_lib" / "libort_triton.so", cache_dir() / "lib" / "libort_triton.so"]
