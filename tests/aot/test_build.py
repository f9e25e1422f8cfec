"""The AOT build on a machine without a GPU: what the library holds and exports, the kernel cache, every
default arch, and the driver message a launch gives where there is no driver."""

import ctypes
import json
import re
import subprocess

import onnxruntime as ort
import pytest

from ort_triton.aot.build import DEFAULT_ARCHS
from ort_triton.ops import ALL_OPS
from tests.conftest import HAS_CUDA, run_cli


def _exported(lib):
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines()}


def test_library_exports_the_entry_point_and_registers(native_library):
    assert "RegisterCustomOps" in _exported(native_library)
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(native_library))
    manifest = json.loads((native_library.parent / "manifest.json").read_text())
    assert manifest["archs"] == [90] and set(manifest["ops"]) == {op.name for op in ALL_OPS}


def test_registration_table_comes_from_the_contracts(native_library):
    lib = ctypes.CDLL(str(native_library))
    lib.ort_triton_op_name.restype = ctypes.c_char_p
    got = {(lib.ort_triton_op_name(i).decode(), lib.ort_triton_op_type(i)) for i in range(lib.ort_triton_num_ops())}
    want = {(op.name, op.element_type(t)) for op in ALL_OPS for t in op.types}
    assert got == want
    for i in range(lib.ort_triton_num_ops()):
        op = next(o for o in ALL_OPS if o.name == lib.ort_triton_op_name(i).decode())
        type_name = next(t for t in op.types if op.element_type(t) == lib.ort_triton_op_type(i))
        assert lib.ort_triton_num_specs(i) == len(op.specializations(type_name))


def test_second_build_compiles_nothing(native_library, tmp_path):
    """The fixture's build filled the cache; the same build again takes every kernel from it."""
    res = run_cli("build", "--arch", "90", "-o", tmp_path)
    assert ", 0 to compile" in res.stdout, res.stdout


def test_kernels_past_the_arch_shared_memory_are_named(native_library, tmp_path):
    """A spec whose shared memory passes what its arch lets a block have would fail at its first launch: the build
    says so, naming the op, spec and arch, and lists it in the manifest (here with sm_90's limit lowered to 16 KB, in
    a process without TRITON_INTERPRET; the kernels come from the cache the fixture filled). With the real limits
    the list is empty (the fixture's own build)."""
    import os
    import sys

    assert json.loads((native_library.parent / "manifest.json").read_text())["too_big"] == []
    code = ("import sys; from ort_triton.aot import build; build.MAX_SHARED = {90: 16384}; "
            "build.build_library((90,), sys.argv[1], log=print)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.search(r"warning: \d+ kernel\(s\) need more shared memory than their GPU lets a block have \(sm_90 "
                     r"16384 B\) and will fail at launch.*spec \d+ .* on sm_90: \d+ B", res.stdout), res.stdout[-2000:]
    too_big = json.loads((tmp_path / "manifest.json").read_text())["too_big"]
    assert too_big and all(re.fullmatch(r"\w+ \(\w+\) spec \d+ \{.*\} on sm_90: \d+ B", t) for t in too_big)


@pytest.mark.slow
def test_default_archs_build(tmp_path):
    res = run_cli("build", "-o", tmp_path, timeout=1800)
    assert json.loads((tmp_path / "manifest.json").read_text())["archs"] == list(DEFAULT_ARCHS), res.stdout
    lib = ctypes.CDLL(str(tmp_path / "libort_triton.so"))
    msg = ctypes.create_string_buffer(512)
    # one of each arch family: an sm_89 GPU runs the sm_86 cubins, a Hopper needs its own
    for arch, picked in ((80, 80), (86, 86), (89, 89), (90, 90), (87, 86)):
        rc = lib.ort_triton_plan(b"LayerNorm", 10, arch, 3, (ctypes.c_int * 3)(1, 1, 1), (ctypes.c_int * 3)(2, 1, 1),
                                 (ctypes.c_int64 * 4)(4, 768, 768, 768), 1, msg, 512)
        assert rc == 0 and f"arch={picked} " in msg.value.decode(), (arch, msg.value)


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without a CUDA driver")
def test_no_driver_message(native_library):
    lib = ctypes.CDLL(str(native_library))
    msg = ctypes.create_string_buffer(1024)
    assert lib.ort_triton_driver_status(msg, 1024) == 1
    text = msg.value.decode()
    assert "libcuda.so.1 could not be loaded" in text and "function bodies run on stock ORT ops" in text
