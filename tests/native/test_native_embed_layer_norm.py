"""The EmbedLayerNorm planner (ort_triton/native/embed_layer_norm.c) through the library's test hooks, on
any machine (no GPU needed): which spec and grid a node gets for every broadcast form of the ids, and the
message for every input it refuses. The expected spec comes from the contract (ops/embed_layer_norm.py),
whose spec order the generated table keeps."""

import ctypes
import re

import pytest

from ort_triton.ops.embed_layer_norm import EMBED_LAYER_NORM, launch_config, layout

FLOAT, FLOAT16, BFLOAT16, INT32, INT64 = 1, 10, 16, 6, 7
TYPE_NAMES = {FLOAT: "float", FLOAT16: "float16", BFLOAT16: "bfloat16"}


@pytest.fixture
def lib(native_library):
    lib = ctypes.CDLL(str(native_library))
    lib.ort_triton_plan_types.argtypes = [
        ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
        ctypes.c_char_p, ctypes.c_size_t,
    ]
    return lib


def shapes(ids=([3, 5], [1, 5], [1, 5]), h=768, vocab=(100, 2, 64), gamma=None, beta=None):
    return [*ids, *([v, h] for v in vocab), gamma or [h], beta or [h]]


def plan(lib, inputs, elem_type=FLOAT, types=None, n_outputs=1):
    """inputs: one shape per input; types: each input's element type (default: int64 ids, elem_type else)."""
    n = len(inputs)
    types = types or [INT64] * 3 + [elem_type] * (n - 3)
    dims = [d for s in inputs for d in s]
    msg = ctypes.create_string_buffer(1024)
    rc = lib.ort_triton_plan_types(b"EmbedLayerNorm", elem_type, 90, n, (ctypes.c_int * n)(*[1] * n),
                                   (ctypes.c_int * n)(*types), (ctypes.c_int * n)(*map(len, inputs)),
                                   (ctypes.c_int64 * max(len(dims), 1))(*dims), n_outputs, msg, len(msg))
    return rc, msg.value.decode()


def parse(msg):
    m = re.fullmatch(r"kernel=\S+ arch=90 grid=(\d+),(\d+),(\d+) block=(\d+) shared=\d+ spec=(\d+)"
                     r"(?: out\d+=\S+)*", msg)
    assert m, msg
    return [int(v) for v in m.groups()]


@pytest.mark.parametrize("elem_type", [FLOAT, FLOAT16, BFLOAT16])
@pytest.mark.parametrize("h", [64, 768, 37, 1000, 4096, 16384])
def test_plan_picks_the_spec_by_h_and_alignment(lib, elem_type, h):
    rc, msg = plan(lib, shapes(h=h), elem_type)
    assert rc == 0, msg
    gx, gy, gz, block, spec = parse(msg)
    specs = EMBED_LAYER_NORM.specializations(TYPE_NAMES[elem_type])
    want = next(i for i, s in enumerate(specs) if s.keys[0][0] <= (h % 16 == 0) <= s.keys[0][1]
                and s.keys[1][0] <= h <= s.keys[1][1])
    assert spec == want and specs[want].constexprs["BLOCK_H"] == layout(h)["BLOCK_H"]
    assert specs[want].keys[0][0] == (h % 16 == 0)  # aligned H takes the spec that assumes it
    rows, warps = launch_config(layout(h)["BLOCK_H"])
    assert (gx, gy, gz, block) == (-(-15 // rows), 1, 1, 32 * warps)


@pytest.mark.parametrize("ids, tokens", [
    (([3, 5], [3, 5], [3, 5]), 15),  # RoBERTa
    (([3, 5], [1, 5], [1, 5]), 15),  # BERT
    (([3, 5], [1, 1], [1, 5]), 15),  # DistilBERT with the rule's zero token type
    (([1, 5], [3, 1], [1, 1]), 15),  # [B, S] is the broadcast, whichever input has each dim
    (([2, 0], [1, 1], [1, 0]), 0),  # empty: an empty grid, the output still [B, 0, H]
])
def test_broadcast_forms_plan(lib, ids, tokens):
    rc, msg = plan(lib, shapes(ids=ids))
    assert rc == 0, msg
    rows, _ = launch_config(1024)
    assert parse(msg)[0] == -(-tokens // rows)


@pytest.mark.parametrize("inputs, types, expected", [
    (shapes(), [INT32, INT64, INT64] + [FLOAT] * 5,
     "ort_triton EmbedLayerNorm (float): input input_ids has element type int32; this op takes int64 there"),
    (shapes(), [INT64, INT64, FLOAT] + [FLOAT] * 5, "input position_ids has element type float; this op takes int64"),
    (shapes(), [INT64] * 3 + [FLOAT16] + [FLOAT] * 4, "input word_embeddings has element type float16"),
    (shapes(ids=([3, 5], [2, 5], [1, 5])), None,
     "input input_ids has shape [3,5], input token_type_ids [2,5] and input position_ids [1,5]; each must be "
     "[1 or B, 1 or S]"),
    (shapes(ids=([3, 5], [1, 5], [1, 4])), None, "input position_ids [1,4]; each must be [1 or B, 1 or S]"),
    (shapes(ids=([15], [1, 5], [1, 5])), None, "input input_ids has shape [15]; it must be [B or 1, S or 1] (rank 2)"),
    (shapes()[:4] + [[2, 767]] + shapes()[5:], None,
     "input token_type_embeddings has shape [2,767]; it must be [V, H] with H = 768, the size of input gamma"),
    (shapes()[:3] + [[100, 768, 1]] + shapes()[4:], None,
     "input word_embeddings has shape [100,768,1]; it must be [V, H]"),
    (shapes(beta=[1, 768]), None, "input beta has shape [1,768]; it must be [768], the shape of input gamma"),
    (shapes(gamma=[1, 768]), None, "input gamma has shape [1,768]; it must be [H]"),
    (shapes(h=16385), None, "hidden size H=16385 (the size of input gamma) is not supported; this library's kernels "
                            "take H up to 16384"),
    (shapes(ids=([1 << 16, 1 << 16], [1, 1], [1, 1])), None, "more than 2147483647 tokens; split the batch"),
])
def test_plan_errors(lib, inputs, types, expected):
    rc, msg = plan(lib, inputs, types=types)
    assert rc != 0 and expected in msg, msg
    assert msg.startswith("ort_triton EmbedLayerNorm (float): "), msg


def test_the_node_has_one_output(lib):
    rc, msg = plan(lib, shapes(), n_outputs=2)
    assert rc != 0 and "the node has 2 outputs; this op has 1" in msg, msg


def test_library_registers_int64_ids(native_library):
    """The generated table declares the ids int64 and the rest of the op's type, for each registration."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ort_triton.contract import DOMAIN

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native_library))
    names = [i.name for i in EMBED_LAYER_NORM.inputs]
    node = helper.make_node("EmbedLayerNorm", names, ["Y"], domain=DOMAIN, epsilon=1e-12)
    graph = helper.make_graph([node], "eln", [
        helper.make_tensor_value_info(n, TensorProto.INT64 if i < 3 else TensorProto.FLOAT16, None)
        for i, n in enumerate(names)], [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, None)])
    model = helper.make_model(graph, ir_version=10,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    # CUDA-only kernels: a CPU session finds the op (types accepted) but no CPU kernel for it
    with pytest.raises(Exception, match="NOT_IMPLEMENTED.*EmbedLayerNorm"):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
