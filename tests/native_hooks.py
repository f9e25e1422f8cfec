"""The native library's planner test hooks (ort_triton/native/ort_triton.c: ort_triton_plan, ort_triton_plan_attrs,
ort_triton_spec_info, ort_triton_op_name) with their argument types declared, and a call of the planner over
input shapes: what the planner tests of every op share."""

import ctypes

FLOAT, FLOAT16, BFLOAT16 = 1, 10, 16


def load(native_library):
    """The library with the planner hooks' argument types declared."""
    lib = ctypes.CDLL(str(native_library))
    lib.ort_triton_plan_attrs.argtypes = [
        ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int,
        ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_size_t,
    ]
    lib.ort_triton_plan.argtypes = lib.ort_triton_plan_attrs.argtypes[:8] + [ctypes.c_char_p, ctypes.c_size_t]
    lib.ort_triton_spec_info.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.ort_triton_op_name.restype = ctypes.c_char_p
    return lib


def plan_attrs(lib, op: str, shapes, n_outputs: int, attrs, elem_type=FLOAT16, arch=90):
    """Plan op over present inputs of these shapes with these attribute values (contract order): (return
    code, the planner's message: its error, or the spec, grid and output shapes it chose)."""
    n = len(shapes)
    msg = ctypes.create_string_buffer(1024)
    rc = lib.ort_triton_plan_attrs(op.encode(), elem_type, arch, n, (ctypes.c_int * n)(*[1] * n),
                                   (ctypes.c_int * n)(*map(len, shapes)),
                                   (ctypes.c_int64 * sum(map(len, shapes)))(*[d for s in shapes for d in s]),
                                   n_outputs, len(attrs), (ctypes.c_double * len(attrs))(*attrs), msg, len(msg))
    return rc, msg.value.decode()


def plan_fields(lib, op: str, shapes, n_outputs: int, attrs, elem_type=FLOAT16, arch=90) -> dict:
    """plan_attrs for a node the planner takes: its message as {field: value} (kernel, arch, grid, block, spec...)."""
    rc, msg = plan_attrs(lib, op, shapes, n_outputs, attrs, elem_type, arch)
    assert rc == 0, msg
    return dict(kv.split("=") for kv in msg.split())


def first_spec(contract, keys, type_name: str = "float16") -> int:
    """The index of the spec the native planner should pick for these dispatch keys: the first of the contract's
    specs, in dispatch order, whose key ranges hold them all (ot_find_spec's rule)."""
    for i, spec in enumerate(contract.specializations(type_name)):
        if len(spec.keys) == len(keys) and all(lo <= k <= hi for k, (lo, hi) in zip(keys, spec.keys)):
            return i
    raise AssertionError(f"{contract.name}: no spec holds keys {keys}")
