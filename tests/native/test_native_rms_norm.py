"""The RMSNorm / AddRMSNorm planner (ort_triton/native/rms_norm.c) through the library's test hooks, on any
machine (no GPU needed): which spec, grid and block a node gets, and the message for every input it
refuses. The expected spec is computed from the contract (ops/rms_norm.py), whose spec order the
generated table keeps."""

import ctypes
import re

import pytest

from ort_triton.ops.rms_norm import ADD_RMS_NORM, RMS_NORM

FLOAT, FLOAT16, BFLOAT16 = 1, 10, 16
TYPE_NAMES = {FLOAT: "float", FLOAT16: "float16", BFLOAT16: "bfloat16"}


@pytest.fixture
def lib(native_library):
    lib = ctypes.CDLL(str(native_library))
    lib.ort_triton_plan.argtypes = [
        ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
    ]
    return lib


def plan(lib, op, inputs, n_outputs=1, elem_type=FLOAT):
    ranks = [len(s) for s in inputs]
    dims = [d for s in inputs for d in s]
    msg = ctypes.create_string_buffer(1024)
    n = len(inputs)
    rc = lib.ort_triton_plan(op.encode(), elem_type, 90, n, (ctypes.c_int * n)(*[1] * n), (ctypes.c_int * n)(*ranks),
                             (ctypes.c_int64 * max(len(dims), 1))(*dims), n_outputs, msg, len(msg))
    return rc, msg.value.decode()


def expected(contract, elem_type, keys, rows):
    """(spec index, grid x, block threads) the planner must choose, from the contract's specs."""
    specs = contract.specializations(TYPE_NAMES[elem_type])
    keys = (*keys, rows)  # (store_sum, h % 16 == 0, H, rows)
    i = next(i for i, s in enumerate(specs) if all(lo <= k <= hi for k, (lo, hi) in zip(keys, s.keys, strict=True)))
    block_rows = specs[i].consts[1]
    return i, -(-rows // block_rows), 32 * specs[i].launch(90)[0]


def parse(msg):
    m = re.fullmatch(r"kernel=rms_norm_fwd arch=90 grid=(\d+),1,1 block=(\d+) shared=\d+ spec=(\d+)"
                     r"(?: out\d+=\S+)*", msg)
    assert m, msg
    grid, block, spec = map(int, m.groups())
    return spec, grid, block


@pytest.mark.parametrize("elem_type", [FLOAT, FLOAT16, BFLOAT16])
@pytest.mark.parametrize("h", [1, 37, 256, 257, 1030, 2048, 4096, 5120, 8192, 16384])
def test_rms_norm_picks_the_block_and_alignment(lib, elem_type, h):
    rc, msg = plan(lib, "RMSNorm", [[3, 7, h], [h]], elem_type=elem_type)
    assert rc == 0, msg
    assert parse(msg) == expected(RMS_NORM, elem_type, (0, int(h % 16 == 0), h), 21)


@pytest.mark.parametrize("n_outputs", [1, 2])
@pytest.mark.parametrize("h", [100, 2048, 4096, 8192])
def test_add_rms_norm_stores_the_sum_only_when_asked(lib, n_outputs, h):
    rc, msg = plan(lib, "AddRMSNorm", [[5, 19, h], [5, 19, h], [h]], n_outputs=n_outputs, elem_type=FLOAT16)
    assert rc == 0, msg
    assert parse(msg) == expected(ADD_RMS_NORM, FLOAT16, (n_outputs - 1, int(h % 16 == 0), h), 95)


@pytest.mark.parametrize("op, n_outputs, warps_few", [("RMSNorm", 1, 8), ("AddRMSNorm", 2, 8), ("AddRMSNorm", 1, 4)])
@pytest.mark.parametrize("rows", [1, 16, 512, 513, 4096])
def test_few_rows_at_2048_take_their_measured_config(lib, op, n_outputs, warps_few, rows):
    """Up to FEW_ROWS rows at H = 2048, the plain and the residual+sum kernels run 1 row x 8 warps (the H200 tuner's
    pick for Llama-1B, ops/rms_norm.py _LAUNCH_FEW); more rows, and the residual kernel without the sum, _LAUNCH's."""
    from ort_triton.ops.rms_norm import FEW_ROWS, launch_config

    inputs = [[rows, 2048]] * (2 if op == "AddRMSNorm" else 1) + [[2048]]
    rc, msg = plan(lib, op, inputs, n_outputs=n_outputs, elem_type=FLOAT16)
    assert rc == 0, msg
    contract = ADD_RMS_NORM if op == "AddRMSNorm" else RMS_NORM
    spec, grid, block = parse(msg)
    assert (spec, grid, block) == expected(contract, FLOAT16, (n_outputs - 1, 1, 2048), rows)
    many = launch_config(2048, op == "AddRMSNorm", n_outputs == 2)
    assert block == 32 * (warps_few if rows <= FEW_ROWS else many[1])


def test_empty_input_plans_an_empty_grid(lib):
    rc, msg = plan(lib, "RMSNorm", [[0, 4096], [4096]])
    assert rc == 0, msg
    assert parse(msg)[1] == 0


@pytest.mark.parametrize("op, inputs, n_outputs, want", [
    ("RMSNorm", [[2, 20000], [20000]], 1,
     "ort_triton RMSNorm (float): hidden size H=20000 is not supported (this library covers 1..16384)"),
    ("RMSNorm", [[2, 768], [767]], 1, "input gamma has shape [767]; it must be [768]"),
    ("RMSNorm", [[2, 768], [1, 768]], 1, "input gamma has shape [1,768]"),
    ("RMSNorm", [[], [768]], 1, "input X has rank 0"),
    ("RMSNorm", [[2, 768], [768]], 2, "the node has 2 outputs"),
    ("AddRMSNorm", [[2, 768], [1, 768], [768]], 1,
     "ort_triton AddRMSNorm (float): input skip has shape [1,768] but input X has shape [2,768]"),
    ("AddRMSNorm", [[2, 3, 768], [2, 768], [768]], 2, "input skip has shape [2,768]"),
    ("AddRMSNorm", [[1 << 16, 1 << 16, 8], [1 << 16, 1 << 16, 8], [8]], 1, "more than 2147483647 rows"),
])
def test_plan_errors(lib, op, inputs, n_outputs, want):
    rc, msg = plan(lib, op, inputs, n_outputs)
    assert rc != 0 and want in msg, msg
