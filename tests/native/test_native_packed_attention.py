"""The PackedMultiHeadAttention planner (ort_triton/native/attention.c, the packed half) through the library's
test hooks, on any machine: the spec, the grid and output shape it plans, and each input it refuses. The
kernel's reads through the packed pointers are checked on the GPU (tests/gpu/test_attention_ort.py)."""

import ctypes
import re

import pytest

from ort_triton.ops.attention import HEAD_DIMS, block_config
from tests.native.test_native_attention import BFLOAT16, FLOAT, FLOAT16, TYPE_NAMES, load, parse

OP = "PackedMultiHeadAttention"


@pytest.fixture
def lib(native_library):
    return load(native_library)


def plan(lib, inputs, num_heads=12, elem_type=FLOAT16, arch=90):
    """inputs: QKV, key_bias, bias shapes. Returns (return code, message)."""
    n = len(inputs)
    msg = ctypes.create_string_buffer(1024)
    rc = lib.ort_triton_plan_attrs(OP.encode(), elem_type, arch, n, (ctypes.c_int * n)(*[1] * n),
                                   (ctypes.c_int * n)(*map(len, inputs)),
                                   (ctypes.c_int64 * sum(map(len, inputs)))(*[d for s in inputs for d in s]), 1,
                                   2, (ctypes.c_double * 2)(num_heads, 0.125), msg, len(msg))
    return rc, msg.value.decode()


def shapes(b, s, hidden):
    return [[b, s, 3 * hidden], [b, s], [3 * hidden]]


@pytest.mark.parametrize("elem_type", [FLOAT, FLOAT16, BFLOAT16])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_plan_picks_the_head_dim_spec(lib, elem_type, d):
    b, s, heads = 3, 37, 4
    rc, msg = plan(lib, shapes(b, s, heads * d), heads, elem_type)
    assert rc == 0, msg
    arch, gx, gy, gz, block, _ = parse(msg)
    cfg = block_config(d, TYPE_NAMES[elem_type])
    assert (arch, gy, gz) == (90, 1, 1)
    assert gx == -(-s // cfg["BLOCK_M"]) * b * heads and block == 32 * cfg["num_warps"]


@pytest.mark.parametrize("s, aligned", [(128, 1), (37, 0)])
def test_plan_takes_the_aligned_spec_only_for_lengths_of_16(lib, s, aligned):
    rc, msg = plan(lib, shapes(2, s, 768))
    assert rc == 0, msg
    assert int(re.search(r"spec=(\d+)", msg).group(1)) == 2 * HEAD_DIMS.index(64) + (0 if aligned else 1)


def test_empty_batch_plans_an_empty_grid(lib):
    rc, msg = plan(lib, shapes(0, 128, 768))
    assert rc == 0 and parse(msg)[1] == 0, msg


@pytest.mark.parametrize("inputs, num_heads, expected", [
    ([[2, 8, 770], [2, 8], [770]], 12,
     "ort_triton PackedMultiHeadAttention (float16): input QKV has shape [2,8,770]; its dim 2 must be 3 x the "
     "hidden size (Q, K, V side by side)"),
    ([[2, 8, 2304], [2, 8], [2304]], 5, "hidden size 768 (a third of dim 2 of input QKV) is not a multiple of "
                                        "num_heads=5"),
    ([[2, 8, 2304], [2, 7], [2304]], 12, "input key_bias has shape [2,7]; it must be [2,8], [B, S] of input QKV "
                                         "(shape [2,8,2304])"),
    ([[2, 8, 2304], [2, 8], [768]], 12, "input bias has shape [768]; it must be [2304]"),
    ([[16, 2304], [2, 8], [2304]], 12, "input QKV has shape [16,2304]; it must have rank 3"),
    ([[2, 8, 72], [2, 8], [72]], 2, "head dim 12 (hidden size 24 / num_heads 2) is not supported"),
])
def test_plan_errors(lib, inputs, num_heads, expected):
    rc, msg = plan(lib, inputs, num_heads)
    assert rc != 0 and expected in msg, msg
