"""`build_library`: every op contract's specialisations -> cubins -> one libort_triton.so.

    contracts -> jobs (op, type, spec, arch) -> triton.compile (parallel, cached) -> codegen -> cc -> .so

Works on a machine without a GPU. The library is written atomically next to a manifest.json that says
what it holds.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

from .. import ops as ops_mod
from .. import tuning
from ..contract import Spec
from ..paths import cache_dir as default_cache_dir
from ..paths import default_library_dir
from .codegen import generate
from .compile import Compiled, Job, compile_job
from .ort_header import find_ort_include

DEFAULT_ARCHS = (80, 86, 89, 90)
# The most shared memory a block may opt into, bytes, per compute capability (CUDA C++ Programming Guide, the
# compute capabilities table). A kernel past it compiles but fails at its first launch on such a GPU: the build says
# so up front and lists it in the manifest. Archs not listed are not checked. The default archs' built-in specs all
# fit; sm_75 (64 KB) leaves out 30 attention specs (head dims 80-128, session 24).
MAX_SHARED = {75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
LIBRARY_NAME = "libort_triton.so"
NATIVE_DIR = pathlib.Path(__file__).resolve().parent.parent / "native"


class BuildError(RuntimeError):
    pass


def _registrations() -> list[tuple]:
    """(contract, element type) in registration order: one native op per pair."""
    return [(op, t) for op in ops_mod.ALL_OPS for t in op.types]


def spec_table(archs, tuned=()) -> dict[tuple[str, str], list[tuple[Spec, tuple[int, ...]]]]:
    """(op name, type) -> [(spec, archs it is compiled for)] in dispatch order: the tuning table's specs
    (each for the arch it was tuned on, so a single-arch tuple) ahead of the built-in ones (every arch)."""
    return {(op.name, t): [(spec, (arch,)) for spec, arch in tuning.tuned_specs(tuned, op, t, archs)]
            + [(spec, tuple(archs)) for spec in op.specializations(t)]
            for op, t in _registrations()}


def _n_tuned(specs) -> int:
    """The tuned specs in a spec_table: those ahead of each op's built-in ones."""
    return sum(len(entries) - len(ops_mod.BY_NAME[name].specializations(t)) for (name, t), entries in specs.items())


def _jobs(specs) -> list[Job]:
    return [Job(op, t, i, spec, arch)
            for op, t in _registrations()
            for i, (spec, spec_archs) in enumerate(specs[(op.name, t)])
            for arch in spec_archs]


def _compile_in_worker(op_name: str, type_name: str, spec_index: int, spec: Spec, arch: int, cache: str) -> Compiled:
    job = Job(ops_mod.BY_NAME[op_name], type_name, spec_index, spec, arch)
    return compile_job(job, pathlib.Path(cache))


def parse_archs(text: str | None) -> tuple[int, ...]:
    if not text:
        return DEFAULT_ARCHS
    try:
        archs = tuple(sorted({int(a.strip().removeprefix("sm_")) for a in text.split(",") if a.strip()}))
    except ValueError:
        raise BuildError(f"--arch takes compute capabilities like 80,86,89,90; got {text!r}") from None
    bad = [a for a in archs if a < 75 or a // 10 > 12]
    if bad or not archs:
        raise BuildError(f"unsupported GPU arch(s) {bad or text}: use compute capabilities such as 80,86,89,90")
    return archs


def build_library(archs=DEFAULT_ARCHS, out_dir=None, *, cache_dir=None, jobs: int | None = None,
                  ort_include=None, cc: str | None = None, log=None, tuning_table=None) -> pathlib.Path:
    """Compile every kernel for `archs`, embed them in libort_triton.so under `out_dir`; returns its path.
    tuning_table: a table from `ort-triton tune` (ort_triton/tuning.py) whose configs are built ahead of the
    built-in ones for the archs they were tuned on."""
    import triton

    log = log or (lambda msg: None)
    archs = parse_archs(archs if isinstance(archs, str) else ",".join(map(str, archs)))  # validated once, here
    cache = pathlib.Path(cache_dir) if cache_dir else default_cache_dir()
    out = pathlib.Path(out_dir) if out_dir else default_library_dir()
    include = find_ort_include(ort_include, cache)
    kernel_cache = cache / "kernels"

    header, tuned = tuning.load(tuning_table) if tuning_table else ({}, [])
    unused = sorted({e.arch for e in tuned if not e.builtin and e.arch not in archs})
    if unused:
        log(f"tuning table: its entries for sm_{', sm_'.join(map(str, unused))} are left out: not in --arch "
            f"{','.join(map(str, archs))}")
    specs = spec_table(archs, tuned)
    n_tuned = _n_tuned(specs)
    if tuning_table:
        log(f"tuning table {tuning_table}: {n_tuned} tuned spec(s) of {len(tuned)} entries")
    all_jobs = _jobs(specs)
    todo = [j for j in all_jobs if not (kernel_cache / f"{j.cache_key()}.cubin").exists()]
    log(f"{len(all_jobs)} kernels for sm_{',sm_'.join(map(str, archs))}: {len(all_jobs) - len(todo)} cached, "
        f"{len(todo)} to compile")
    t0 = time.time()
    compiled: dict = {}
    workers = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    if todo and workers > 1:
        ctx = multiprocessing.get_context("spawn")  # no Triton state shared across a fork
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            futures = {pool.submit(_compile_in_worker, j.op.name, j.type_name, j.spec_index, j.spec, j.arch,
                                   str(kernel_cache)): j for j in todo}
            for n, fut in enumerate(concurrent.futures.as_completed(futures), 1):
                j = futures[fut]
                try:
                    compiled[(j.op.name, j.type_name, j.spec_index, j.arch)] = fut.result()
                except Exception as e:  # name the kernel: a bare Triton traceback says too little
                    raise BuildError(f"compiling {j.op.name} ({j.type_name}) spec {j.spec_index} "
                                     f"{j.spec.constexprs} for sm_{j.arch} failed: {e}") from e
                if n % 50 == 0:
                    log(f"  compiled {n}/{len(todo)}")
    for j in all_jobs:  # cached ones, and everything when running in one process
        key = (j.op.name, j.type_name, j.spec_index, j.arch)
        if key not in compiled:
            compiled[key] = compile_job(j, kernel_cache)
    if todo:
        log(f"compiled {len(todo)} kernels in {time.time() - t0:.1f} s")
    too_big = []
    for j in all_jobs:
        shared = compiled[(j.op.name, j.type_name, j.spec_index, j.arch)].shared
        if shared > MAX_SHARED.get(j.arch, shared):
            too_big.append(f"{j.op.name} ({j.type_name}) spec {j.spec_index} {j.spec.constexprs} on sm_{j.arch}: "
                           f"{shared} B")
    if too_big:  # kept, not dropped: the rest of the op (other head dims, other archs) is still worth having
        log(f"warning: {len(too_big)} kernel(s) need more shared memory than their GPU lets a block have ("
            f"{', '.join(f'sm_{a} {MAX_SHARED[a]} B' for a in archs if a in MAX_SHARED)}) and will fail at launch "
            f"there with a message that names the op; the manifest lists them (\"too_big\"): " +
            "; ".join(too_big[:8]) + (f"; and {len(too_big) - 8} more" if len(too_big) > 8 else ""))

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ort_triton_build_") as tmp:
        tmp = pathlib.Path(tmp)
        table, images = generate(_registrations(), specs, compiled, list(archs), tmp, triton.__version__)
        lib_tmp = out / f".{LIBRARY_NAME}.{os.getpid()}.tmp"
        cmd = [cc or os.environ.get("CC", "cc"), "-std=c11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
               "-Wall", "-Wextra", "-Werror", f"-I{include}", f"-I{NATIVE_DIR}",
               *sorted(map(str, NATIVE_DIR.glob("*.c"))), str(table), str(images),
               # an op whose planner is missing fails here, not when ORT dlopens the library
               "-ldl", "-lpthread", "-Wl,--no-undefined", "-o", str(lib_tmp)]
        log("$ " + shlex.join(cmd))
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            lib_tmp.unlink(missing_ok=True)
            raise BuildError(f"C compiler failed ({res.returncode}):\n{res.stderr[-4000:]}")
        lib = out / LIBRARY_NAME
        os.replace(lib_tmp, lib)
    manifest = {
        "library": LIBRARY_NAME, "archs": list(archs), "triton": triton.__version__,
        "ops": sorted({op.name for op, _ in _registrations()}),
        "kernels": len(all_jobs), "python": sys.version.split()[0], "too_big": too_big,
        "tuning": {"table": str(tuning_table), "tuned_specs": n_tuned, "gpu": header.get("gpu"),
                   "model": header.get("model")} if tuning_table else None,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"wrote {lib} ({lib.stat().st_size / 1e6:.1f} MB)")
    return lib

