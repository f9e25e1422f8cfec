"""The MultiHeadAttention planner (ort_triton/native/attention.c) through the library's test hooks, on any
machine (no GPU needed): which spec and grid a node gets, and the message for every input it refuses.

The planner needs the node's attributes (num_heads fixes the head dim), which `ort_triton_plan_attrs`
passes; `ort_triton_plan` plans with the defaults (num_heads = 1).
"""

import ctypes
import re

import pytest

from ort_triton.contract import ANY
from ort_triton.ops.attention import HEAD_DIMS, block_config
from tests.native_hooks import BFLOAT16, FLOAT, FLOAT16, load

TYPE_NAMES = {FLOAT: "float", FLOAT16: "float16", BFLOAT16: "bfloat16"}
OP = "MultiHeadAttention"


@pytest.fixture
def lib(native_library):
    return load(native_library)


def plan(lib, inputs, num_heads=None, scale=0.125, elem_type=FLOAT16, arch=90):
    """inputs: Q, K, V, key_bias shapes. Returns (return code, message); num_heads=None: the hook without
    attributes (the defaults)."""
    n = len(inputs)
    args = [OP.encode(), elem_type, arch, n, (ctypes.c_int * n)(*[1] * n), (ctypes.c_int * n)(*map(len, inputs)),
            (ctypes.c_int64 * sum(map(len, inputs)))(*[d for s in inputs for d in s]), 1]
    msg = ctypes.create_string_buffer(1024)
    if num_heads is None:
        rc = lib.ort_triton_plan(*args, msg, len(msg))
    else:
        rc = lib.ort_triton_plan_attrs(*args, 2, (ctypes.c_double * 2)(num_heads, scale), msg, len(msg))
    return rc, msg.value.decode()


def parse(msg):
    m = re.fullmatch(r"kernel=(\S+) arch=(\d+) grid=(\d+),(\d+),(\d+) block=(\d+) shared=(\d+) spec=\d+"
                     r"(?: out\d+=\S+)*", msg)
    assert m, msg
    return [int(v) for v in m.groups()[1:]]


def shapes(b, sq, skv, hidden):
    return [[b, sq, hidden], [b, skv, hidden], [b, skv, hidden], [b, skv], [hidden], [hidden]]


@pytest.mark.parametrize("elem_type", [FLOAT, FLOAT16, BFLOAT16])
def test_table_holds_one_spec_per_head_dim(lib, elem_type):
    i = next(i for i in range(lib.ort_triton_num_ops())
             if lib.ort_triton_op_name(i).decode() == OP and lib.ort_triton_op_type(i) == elem_type)
    msg = ctypes.create_string_buffer(1024)
    keys = []
    for s in range(lib.ort_triton_num_specs(i)):
        assert lib.ort_triton_spec_info(i, s, msg, len(msg)) == 0
        keys.append(re.match(r"kernel=attention_fwd keys=(\S+)", msg.value.decode()).group(1))
    assert keys == [f"{d}:{d},{aligned}:1,0:{ANY},0:{ANY}" for d in HEAD_DIMS for aligned in (1, 0)]  # any Sq, B * N


@pytest.mark.parametrize("sq, skv, aligned", [(64, 128, 1), (2048, 2048, 1), (37, 128, 0), (64, 50, 0), (8, 1, 0)])
def test_plan_takes_the_aligned_spec_only_for_lengths_of_16(lib, sq, skv, aligned):
    """Sq and Skv multiples of 16 get the spec compiled with that promise (its key-bias loads pipeline);
    any other length the general one: a promise the shapes break would be a wrong result."""
    rc, msg = plan(lib, shapes(2, sq, skv, 768), 12)
    assert rc == 0, msg
    spec = int(re.search(r"spec=(\d+)", msg).group(1))
    assert spec == 2 * HEAD_DIMS.index(64) + (0 if aligned else 1)


@pytest.mark.parametrize("elem_type", [FLOAT, FLOAT16, BFLOAT16])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_plan_picks_the_head_dim_spec(lib, elem_type, d):
    """Grid and block follow the spec's BLOCK_M and num_warps from block_config: one flat axis of
    ceil(Sq / BLOCK_M) * B * N programs."""
    b, sq, heads = 3, 37, 8
    rc, msg = plan(lib, shapes(b, sq, 50, heads * d), heads, elem_type=elem_type)
    assert rc == 0, msg
    arch, gx, gy, gz, block, shared = parse(msg)
    cfg = block_config(d, TYPE_NAMES[elem_type])
    assert arch == 90 and (gy, gz) == (1, 1)
    assert gx == -(-sq // cfg["BLOCK_M"]) * b * heads
    assert block == 32 * cfg["num_warps"] and 0 < shared <= 227 * 1024


@pytest.mark.parametrize("d", [16, 24, 48, 56, 72, 120, 136, 256])
def test_head_dims_between_the_specs_are_refused(lib, d):
    rc, msg = plan(lib, shapes(2, 8, 8, 2 * d), 2)
    assert rc != 0 and f"head dim {d} (hidden size {2 * d} / num_heads 2) is not supported" in msg


def test_hook_without_attributes_plans_with_the_defaults(lib):
    """num_heads defaults to 1: hidden 64 is one head of 64."""
    rc, msg = plan(lib, shapes(2, 8, 8, 64))
    assert rc == 0, msg
    rc, msg = plan(lib, shapes(2, 8, 8, 768))
    assert rc != 0 and "head dim 768 (hidden size 768 / num_heads 1)" in msg


def test_large_batch_times_heads_fits_the_flat_grid(lib):
    """B * N = 98304 is past grid.y's 65535; the flat grid.x takes it."""
    rc, msg = plan(lib, shapes(8192, 1, 1, 768), 12)
    assert rc == 0, msg
    assert parse(msg)[1:4] == [8192 * 12, 1, 1]


@pytest.mark.parametrize("b, sq", [(0, 128), (4, 0)])
def test_empty_batch_or_queries_plan_an_empty_grid(lib, b, sq):
    rc, msg = plan(lib, shapes(b, sq, 16, 768), 12)
    assert rc == 0, msg
    assert parse(msg)[1] == 0


def test_no_keys_still_launches(lib):
    """Skv = 0: Y is 0 (the function body's empty MatMul); the kernel writes it, so the grid is not empty."""
    rc, msg = plan(lib, shapes(2, 5, 0, 768), 12)
    assert rc == 0, msg
    assert parse(msg)[1] > 0


@pytest.mark.parametrize(
    "inputs, num_heads, elem_type, expected",
    [
        (shapes(2, 8, 8, 12), 1, FLOAT16,
         ["ort_triton MultiHeadAttention (float16): head dim 12 (hidden size 12 / num_heads 1) is not supported; "
          "this library has kernels for head dims 32, 40, 64, 80, 96, 128 (the rewriter should not have fused"]),
        (shapes(2, 8, 8, 768), 5, FLOAT,
         ["ort_triton MultiHeadAttention (float): hidden size 768 (dim 2 of input Q) is not a multiple of "
          "num_heads=5"]),
        (shapes(2, 8, 8, 768), 0, FLOAT, ["attribute num_heads=0 must be an integer in 1.."]),
        (shapes(2, 8, 8, 768), 2.5, FLOAT, ["attribute num_heads=2.5 must be an integer"]),
        ([[2, 8, 768], [2, 8, 768], [2, 9, 768], [2, 8]], 12, BFLOAT16,
         ["ort_triton MultiHeadAttention (bfloat16): input V has shape [2,9,768] but input K has shape [2,8,768]; "
          "they must be equal"]),
        ([[2, 8, 768], [2, 8, 768], [2, 8, 384], [2, 8]], 12, FLOAT16, ["input V has shape [2,8,384] but input K"]),
        ([[2, 8, 768], [3, 8, 768], [3, 8, 768], [3, 8]], 12, FLOAT16,
         ["input K has shape [3,8,768] but input Q has shape [2,8,768]; they must agree in batch"]),
        ([[2, 8, 768], [2, 8, 512], [2, 8, 512], [2, 8]], 8, FLOAT16, ["and hidden size (dim 2)"]),
        ([[2, 8, 768], [2, 6, 768], [2, 6, 768], [2, 8]], 12, FLOAT16,
         ["input key_bias has shape [2,8]; it must be [2,6], [B, Skv] of inputs Q and K"]),
        ([[2, 8, 768], [2, 6, 768], [2, 6, 768], [2, 1, 1, 6]], 12, FLOAT16, ["input key_bias has shape [2,1,1,6]"]),
        ([[2, 8, 768], [2, 6, 768], [2, 6, 768], [6]], 12, FLOAT16, ["input key_bias has shape [6]"]),
        ([[16, 768], [2, 6, 768], [2, 6, 768], [2, 6]], 12, FLOAT16,
         ["input Q has shape [16,768]; it must have rank 3, [B, S, num_heads * head_dim]"]),
        ([[2, 8, 768], [2, 1, 6, 768], [2, 1, 6, 768], [2, 6]], 12, FLOAT16, ["input K has shape [2,1,6,768]"]),
        ([[2, -1, 768], [2, 6, 768], [2, 6, 768], [2, 6]], 12, FLOAT16, ["input Q has a negative dimension"]),
        (shapes(1, (1 << 31) - 1, 8, 768), 12, FLOAT16, ["sequence length 2147483647 (dim 1 of input Q) is more"]),
        (shapes(1, 8, (1 << 31) - 1, 768), 12, FLOAT16, ["(dim 1 of input K)"]),
        ([[2, 8, 768], [2, 6, 768], [2, 6, 768], [2, 6], [1, 768], [768]], 12, FLOAT16,
         ["input k_bias has shape [1,768]; it must be [768]"]),
        ([[2, 8, 768], [2, 6, 768], [2, 6, 768], [2, 6], [768], [64]], 12, FLOAT16,
         ["input v_bias has shape [64]; it must be [768]"]),
        (shapes(1 << 16, 1 << 20, 8, 768), 12, FLOAT16,
         ["the launch needs ceil(Sq / 128) * B * num_heads = 8192 * 65536 * 12 programs, more than the 2147483647 "
          "a CUDA grid holds; split the batch"]),
    ],
)
def test_plan_errors(lib, inputs, num_heads, elem_type, expected):
    if len(inputs) == 4:  # the cases about Q, K, V and key_bias: well-formed biases
        inputs = inputs + [[768]] * 2
    rc, msg = plan(lib, inputs, num_heads, elem_type=elem_type)
    assert rc != 0
    for text in expected:
        assert text in msg, msg


def test_missing_key_bias_is_refused(lib):
    n = 6
    msg = ctypes.create_string_buffer(1024)
    rc = lib.ort_triton_plan_attrs(OP.encode(), FLOAT16, 90, n, (ctypes.c_int * n)(1, 1, 1, 0, 1, 1),
                                   (ctypes.c_int * n)(3, 3, 3, 0, 1, 1),
                                   (ctypes.c_int64 * 11)(*[2, 8, 768] * 3, 768, 768), 1, 2,
                                   (ctypes.c_double * 2)(12, 0.125), msg, len(msg))
    assert rc != 0 and "required input key_bias is missing" in msg.value.decode()
