"""Compile one (op, element type, specialisation, arch) to a cubin with `triton.compile`, cached on disk.

`triton.compile` with an explicit GPUTarget needs no GPU (Triton ships ptxas). The cache key covers the
kernel source (the files of the kernel and of every Triton function it can reach), the specialisation,
the launch options (the register cap too), the Triton version and the arch, so a rebuild after one change
recompiles the kernels of the files that changed.

Why not Triton's own `JITFunction.cache_key`: in Triton 3.6 it depends on what was hashed before it in the
process (CausalAttention's kernel, which calls kernels/attention.py's `_attend`, hashed differently after
MultiHeadAttention's kernel than before it), so a build worker that compiled only causal kernels stored
them under keys the parent never looked up, and every build recompiled them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import pathlib
import tempfile

from ..contract import OpContract, Spec

TRITON_TYPES = {"float": "fp32", "float16": "fp16", "bfloat16": "bf16"}
PDL_MIN_ARCH = 90  # griddepcontrol (programmatic dependent launch) is sm_90's


@dataclasses.dataclass(frozen=True)
class Job:
    op: OpContract
    type_name: str
    spec_index: int
    spec: Spec
    arch: int

    @property
    def pdl(self) -> int:
        """1 where the kernel runs programmatic dependent launch (contract.Kernel.pdl): sm_90 and later."""
        return int(self.op.kernel.pdl and self.arch >= PDL_MIN_ARCH)

    def constexprs(self) -> dict:
        return dict(self.spec.constexprs, **({"PDL": self.pdl} if self.op.kernel.pdl else {}))

    def signature(self) -> dict[str, str]:
        t = TRITON_TYPES[self.type_name]
        sig = {k: v.replace("{T}", t) for k, v in self.op.kernel.signature.items()}
        sig.update({k: "constexpr" for k in self.constexprs()})
        return sig

    def cache_key(self) -> str:
        import triton

        blob = json.dumps({
            "fn": source_key(self.op.kernel.fn),
            "sig": self.signature(),
            "constexprs": self.constexprs(),
            "div16": self.spec.divisible_by_16,
            "launch": self.spec.launch(self.arch),
            "maxnreg": self.spec.maxnreg,
            "triton": triton.__version__,
            "arch": self.arch,
        }, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]


def source_key(fn) -> str:
    """sha256 over the source files of a Triton kernel and of every Triton function reachable through the
    globals of the modules involved (the constexpr globals the kernels use live in those modules too)."""
    from triton.runtime.jit import JITFunction

    files, stack, seen = set(), [fn], set()
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        files.add(inspect.getsourcefile(f.fn))
        stack.extend(v for v in f.fn.__globals__.values() if isinstance(v, JITFunction))
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.rsplit("/", 1)[-1].encode() + b"\0" + pathlib.Path(path).read_bytes())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Compiled:
    kernel_name: str
    cubin: pathlib.Path
    shared: int
    num_warps: int
    # Triton's global scratch, bytes a program (0 for most kernels): tensor descriptors made on the device live
    # there (the warp-specialised attention's). The native launcher allocates it from ORT's arena.
    global_scratch: int = 0
    pdl: int = 0  # 1: compiled with PDL = 1, launched with programmatic stream serialization (Job.pdl)


def compile_job(job: Job, cache_dir: pathlib.Path) -> Compiled:
    key = job.cache_key()
    cubin, meta_path = cache_dir / f"{key}.cubin", cache_dir / f"{key}.json"
    if cubin.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        return Compiled(meta["name"], cubin, meta["shared"], meta["num_warps"], meta.get("global_scratch", 0),
                        job.pdl)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = job.op.kernel.fn
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in job.spec.divisible_by_16}
    src = ASTSource(fn, job.signature(), constexprs=job.constexprs(), attrs=attrs)
    warps, stages = job.spec.launch(job.arch)
    options = {"num_warps": warps, "num_stages": stages}
    if job.spec.maxnreg is not None:
        options["maxnreg"] = job.spec.maxnreg
    k = triton.compile(src, target=GPUTarget("cuda", job.arch, 32), options=options)
    md = k.metadata
    # The native launcher passes NULL for Triton's profile scratch and allocates global scratch (size a program
    # times the grid) from ORT's arena, whose blocks are 256-byte aligned: refuse what it cannot give rather
    # than ship a kernel that would scribble over address 0.
    if md.profile_scratch_size or (md.global_scratch_size and 256 % max(1, md.global_scratch_align)):
        raise RuntimeError(f"{job.op.name} spec {job.spec_index} sm_{job.arch}: kernel needs Triton profile scratch "
                           f"({md.profile_scratch_size} B) or global scratch aligned to "
                           f"{md.global_scratch_align} B, not supported")
    # num_warps is what the launch needs: a warp-specialised kernel runs more warps than it was compiled with
    # (its producer and consumer groups)
    meta = {"name": md.name, "shared": int(md.shared), "num_warps": int(md.num_warps),
            "global_scratch": int(md.global_scratch_size)}
    cache_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(cubin, k.asm["cubin"])
    _atomic_write(meta_path, json.dumps(meta).encode())
    return Compiled(meta["name"], cubin, meta["shared"], meta["num_warps"], meta["global_scratch"], job.pdl)


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
