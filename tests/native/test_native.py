"""The native library through ctypes, on any machine (no GPU needed).

Plans and their error messages come from the library's test hooks, which run the same planner and
arch choice as a CUDA compute call; loading into a CPU build of onnxruntime checks registration.
`native_library` (tests/conftest.py) is a libort_triton.so built for sm_90 only.
"""

import ctypes
import re

import pytest

FLOAT, FLOAT16, BFLOAT16, DOUBLE = 1, 10, 16, 11


@pytest.fixture
def lib(native_library):
    lib = ctypes.CDLL(str(native_library))
    lib.ort_triton_plan.argtypes = [
        ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
    ]
    lib.ort_triton_spec_info.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.ort_triton_build_info.restype = ctypes.c_char_p
    lib.ort_triton_op_name.restype = ctypes.c_char_p
    return lib


def plan(lib, op, inputs, n_outputs=1, elem_type=FLOAT, arch=90):
    """inputs: one shape per input, None where absent. Returns (return code, message)."""
    present = [s is not None for s in inputs]
    ranks = [len(s) if s is not None else 0 for s in inputs]
    dims = [d for s in inputs if s is not None for d in s]
    msg = ctypes.create_string_buffer(1024)
    rc = lib.ort_triton_plan(
        op.encode(), elem_type, arch, len(inputs), (ctypes.c_int * len(inputs))(*present),
        (ctypes.c_int * len(inputs))(*ranks), (ctypes.c_int64 * max(len(dims), 1))(*dims), n_outputs, msg, len(msg),
    )
    return rc, msg.value.decode()


def first_spec(lib, op, elem_type, keys):
    """(kernel name, key ranges) of the first spec of (op, elem_type) whose ranges hold keys, read from
    the table: what the plan must pick."""
    i = next(i for i in range(lib.ort_triton_num_ops())
             if lib.ort_triton_op_name(i).decode() == op and lib.ort_triton_op_type(i) == elem_type)
    msg = ctypes.create_string_buffer(1024)
    for s in range(lib.ort_triton_num_specs(i)):
        assert lib.ort_triton_spec_info(i, s, msg, len(msg)) == 0
        m = re.match(r"kernel=(\S+) keys=(\S+)", msg.value.decode())
        ranges = [tuple(int(v) for v in r.split(":")) for r in m.group(2).split(",")]
        if len(ranges) == len(keys) and all(lo <= k <= hi for k, (lo, hi) in zip(keys, ranges)):
            return m.group(1), ranges
    raise AssertionError(f"no spec of {op} holds {keys}")


def parse(msg):
    m = re.fullmatch(r"kernel=(\S+) arch=(\d+) grid=(\d+),(\d+),(\d+) block=(\d+) shared=(\d+) spec=\d+"
                     r"(?: out\d+=\S+)*", msg)
    assert m, msg
    return m.group(1), [int(v) for v in m.groups()[1:]]


@pytest.mark.parametrize("elem_type", [FLOAT, FLOAT16, BFLOAT16])
@pytest.mark.parametrize("h, aligned", [(768, 1), (769, 0)])
def test_layer_norm_plan_picks_spec_by_alignment(lib, elem_type, h, aligned):
    rc, msg = plan(lib, "LayerNorm", [[4, 8, h], [h], [h]], elem_type=elem_type)
    assert rc == 0, msg
    kernel, (arch, gx, gy, gz, block, _shared) = parse(msg)
    want, ranges = first_spec(lib, "LayerNorm", elem_type, [1, 0, aligned, h, 32])  # 32 rows
    assert kernel == want
    assert ranges[2][0] == aligned  # aligned H gets the spec that assumes H % 16 == 0, odd H one that does not
    assert arch == 90 and 1 <= gx <= 32 and (gy, gz) == (1, 1) and block % 32 == 0


@pytest.mark.parametrize("op, n_outputs", [("LayerNorm", 1), ("AddLayerNorm", 1), ("AddLayerNorm", 2)])
@pytest.mark.parametrize("h", [768, 1536, 3072])
def test_thirds_sizes_pick_their_own_spec(lib, op, n_outputs, h):
    """H = 3 * 2^k has a spec of its own (three full blocks), ahead of the block that would hold it."""
    from ort_triton.ops import ADD_LAYER_NORM, LAYER_NORM

    shapes = [[3, h], [h], [h]] if op == "LayerNorm" else [[3, h], [3, h], [h], [h], [h]]
    rc, msg = plan(lib, op, shapes, n_outputs=n_outputs)
    assert rc == 0, msg
    kernel, ranges = first_spec(lib, op, FLOAT, [1, int(n_outputs == 2), 1, h, 3])
    assert parse(msg)[0] == kernel and ranges[3] == (h, h)
    contract = LAYER_NORM if op == "LayerNorm" else ADD_LAYER_NORM
    spec = next(sp for sp in contract.specializations("float")
                if sp.keys[3] == (h, h) and sp.keys[1] == tuple(ranges[1]))
    assert spec.constexprs["CHUNKS"] == 3 and spec.constexprs["BLOCK_H"] * 3 == h


@pytest.mark.parametrize("n_rows", [4096, 16384, 16385, 65536])
@pytest.mark.parametrize("n_outputs", [1, 2])
def test_row_count_picks_the_launch_config(lib, n_rows, n_outputs):
    """AddLayerNorm at H=768 takes 2 rows a program up to FEW_ROWS rows and 1 row past it (the grid says)."""
    from ort_triton.ops.layer_norm import FEW_ROWS, launch_config

    rc, msg = plan(lib, "AddLayerNorm", [[n_rows, 768], [n_rows, 768], [768], [768], [768]], n_outputs=n_outputs)
    assert rc == 0, msg
    rows, _warps = launch_config(768, True, n_outputs == 2, n_rows=n_rows)
    assert rows == (2 if n_rows <= FEW_ROWS else 1)
    assert parse(msg)[1][1] == -(-n_rows // rows)


def test_add_layer_norm_with_sum_output_picks_store_sum_spec(lib):
    rc, msg = plan(lib, "AddLayerNorm", [[2, 1024], [2, 1024], [1024], [1024], [1024]], n_outputs=2)
    assert rc == 0, msg
    assert parse(msg)[0] == first_spec(lib, "AddLayerNorm", FLOAT, [1, 1, 1, 1024, 2])[0]


def test_empty_tensor_plans_an_empty_grid(lib):
    rc, msg = plan(lib, "LayerNorm", [[0, 768], [768], [768]])
    assert rc == 0, msg
    assert parse(msg)[1][1:4] == [0, 1, 1]


@pytest.mark.parametrize(
    "op, inputs, n_outputs, elem_type, arch, expected",
    [
        ("LayerNorm", [[2, 768], [768], [768]], 1, DOUBLE, 90,
         ["ort_triton LayerNorm (double): element type double is not supported", "float16"]),
        ("Softmax", [[2, 768]], 1, FLOAT, 90, ["unknown op Softmax", "LayerNorm"]),
        ("LayerNorm", [[], [768], [768]], 1, FLOAT, 90, ["ort_triton LayerNorm (float): input X has rank 0"]),
        ("LayerNorm", [None, [768], [768]], 1, FLOAT, 90, ["required input X is missing"]),
        ("LayerNorm", [[2, 768], [767], [768]], 1, FLOAT16, 90,
         ["ort_triton LayerNorm (float16): input gamma has shape [767]; it must be [768]"]),
        ("LayerNorm", [[2, 768], [768], [1, 768]], 1, FLOAT, 90, ["input beta has shape [1,768]"]),
        ("AddLayerNorm", [[2, 768], [1, 768], [768], [768], [768]], 1, BFLOAT16, 90,
         ["ort_triton AddLayerNorm (bfloat16): input skip has shape [1,768] but input X has shape [2,768]"]),
        ("AddLayerNorm", [[2, 768], [2, 768], [2, 768], [768], [768]], 1, FLOAT16, 90,
         ["ort_triton AddLayerNorm (float16): input bias has shape [2,768]; it must be [768]"]),
        ("LayerNorm", [[2, 1 << 20], [1 << 20], [1 << 20]], 1, FLOAT, 90,
         ["hidden size H=1048576 is not supported (this library covers "]),
        ("LayerNorm", [[2, 768], [768], [768]], 2, FLOAT, 90, ["the node has 2 outputs"]),
        ("LayerNorm", [[2, 768], [768], [768]], 1, FLOAT, 80,
         ["no kernel image for this GPU (sm_80)", "sm_90", "rebuild with: ort-triton build --arch 80"]),
    ],
)
def test_plan_errors(lib, op, inputs, n_outputs, elem_type, arch, expected):
    rc, msg = plan(lib, op, inputs, n_outputs, elem_type, arch)
    assert rc != 0
    for text in expected:
        assert text in msg


def test_table_hooks(lib):
    assert lib.ort_triton_build_info()
    ops = {(lib.ort_triton_op_name(i).decode(), lib.ort_triton_op_type(i)) for i in range(lib.ort_triton_num_ops())}
    assert {("LayerNorm", t) for t in (FLOAT, FLOAT16, BFLOAT16)} <= ops
    assert {("AddLayerNorm", t) for t in (FLOAT, FLOAT16, BFLOAT16)} <= ops
    assert lib.ort_triton_op_name(-1) is None and lib.ort_triton_op_name(lib.ort_triton_num_ops()) is None


def test_cpu_onnxruntime_registers_and_refuses_cpu_session(native_library):
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native_library))
    node = helper.make_node("LayerNorm", ["X", "gamma", "beta"], ["Y"], domain="ai.ort_triton", epsilon=1e-5)
    graph = helper.make_graph(
        [node], "ln",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 768]),
         helper.make_tensor_value_info("gamma", TensorProto.FLOAT, [768]),
         helper.make_tensor_value_info("beta", TensorProto.FLOAT, [768])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 768])],
    )
    model = helper.make_model(graph, ir_version=10,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ort_triton", 1)])
    onnx.checker.check_model(model)
    # The ops are CUDA-only: a CPU session finds no kernel for them and says so instead of crashing.
    with pytest.raises(Exception, match="NOT_IMPLEMENTED.*LayerNorm"):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

