"""`ort-triton doctor`: what this machine has for ort_triton, and how to fix what is missing."""

from __future__ import annotations

import ctypes
import importlib.metadata
import json

from rich.console import Console
from rich.table import Table


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpus() -> tuple[list[str], str | None]:
    """GPU names and compute capabilities through the driver alone (no torch, no CUDA runtime)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return [], f"no CUDA driver (libcuda.so.1: {e})"
    if cuda.cuInit(0) != 0:
        return [], "CUDA driver present but cuInit failed (no usable GPU?)"
    n = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(n))
    found = []
    for i in range(n.value):
        dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, 256, dev)
        found.append(f"{i}: {name.value.decode()} (sm_{major.value}{minor.value})")
    return found, None


def report(con: Console) -> list[str]:
    """Print the state; return the problems found (each with its fix)."""
    from .runtime import LibraryNotFound, get_library_path

    problems: list[str] = []
    table = Table(title="ort-triton doctor", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("state")

    ort_version = None
    try:
        import onnxruntime as ort

        ort_version = ort.__version__
        providers = ort.get_available_providers()
        build = "onnxruntime-gpu" if _version("onnxruntime-gpu") else "CPU build"
        table.add_row("onnxruntime", f"{ort_version} ({build})")
        table.add_row("providers", ", ".join(providers))
        if "CUDAExecutionProvider" not in providers:
            problems.append("no CUDAExecutionProvider: `pip install ort-triton[gpu]` (onnxruntime-gpu) to run the "
                            "kernels; rewritten models still run on CPU through their function bodies")
    except ImportError:
        table.add_row("onnxruntime", "[red]not installed[/]")
        problems.append("onnxruntime missing: `pip install ort-triton[gpu]` or `ort-triton[cpu]`")

    gpus, gpu_problem = _gpus()
    table.add_row("GPUs", "\n".join(gpus) if gpus else f"[yellow]{gpu_problem}[/]")
    if gpu_problem:
        problems.append(gpu_problem + ": the library loads but its kernels cannot run here")

    try:
        lib = get_library_path()
        info = ctypes.CDLL(str(lib))
        info.ort_triton_build_info.restype = ctypes.c_char_p
        table.add_row("library", str(lib))
        table.add_row("library build", info.ort_triton_build_info().decode())
        manifest = lib.parent / "manifest.json"
        archs = json.loads(manifest.read_text())["archs"] if manifest.exists() else []
        for g in gpus:
            arch = int(g.rsplit("sm_", 1)[1].rstrip(")"))
            if not any(a // 10 == arch // 10 and a <= arch for a in archs):
                problems.append(f"library has no kernels for sm_{arch} (it holds {archs}): "
                                f"`ort-triton build --arch {arch}`")
        if ort_version:
            import onnxruntime as ort

            ort.SessionOptions().register_custom_ops_library(str(lib))
            table.add_row("registers in ORT", "[green]yes[/]")
    except LibraryNotFound as e:
        table.add_row("library", "[red]not built[/]")
        problems.append(str(e))
    except (OSError, AttributeError, RuntimeError) as e:
        table.add_row("library", f"[red]unusable: {e}[/]")
        problems.append(f"library unusable ({e}): rebuild with `ort-triton build`")

    triton_version = _version("triton")
    table.add_row("triton (build only)", triton_version or "not installed")
    if not triton_version:
        problems.append("triton missing (needed only to build the library): `pip install ort-triton[build]`")
    elif triton_version.split(".")[:2] != ["3", "6"]:
        problems.append(f"triton {triton_version}: kernels are tested with 3.6 (`pip install triton==3.6.0`)")
    for dist in ("onnx", "onnxscript", "onnx-ir", "torch", "transformers"):
        table.add_row(dist, _version(dist) or "not installed")

    con.print(table)
    for p in problems:
        con.print(f"[yellow]-[/] {p}")
    if not problems:
        con.print("[green]all good[/]")
    return problems
