"""The CausalAttention planner (ort_triton/native/causal_attention.c) through the library's test hooks, on any
machine (no GPU needed): which spec and grid a node gets, and the message for every input it refuses."""

import ctypes
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ort_triton.ops.causal_attention import (
    CAUSAL_HEAD_DIMS,
    DECODE_ROWS,
    DECODE_WIDE,
    MERGE_COUNTERS,
    SPLIT_MIN_KEYS,
    SPLIT_TARGET,
    block_config,
    split_chunks,
    split_keys,
    workspace_floats,
)
from tests.native_hooks import BFLOAT16, FLOAT, FLOAT16, load, plan_attrs

PREFILL_M = block_config(64, "float16", DECODE_ROWS + 1)["BLOCK_M"]  # the fp16 prefill tile at head dim 64
ANY = 1 << 62


def spec_ranges(type_name):
    """The built-in specs' (head dim, rows, B * Nkv, seq_major) ranges in table order: per cache layout (heads first,
    then sequence first) and head dim the decode spec (two, below and from DECODE_WIDE programs, where the wide
    config differs), then the prefill spec."""
    out = []
    for sm in (0, 1):
        for d in CAUSAL_HEAD_DIMS:
            wide = block_config(d, type_name, DECODE_ROWS, DECODE_WIDE) != block_config(d, type_name, DECODE_ROWS)
            for programs in ((0, DECODE_WIDE - 1), (DECODE_WIDE, ANY)) if wide else ((0, ANY),):
                out.append(((d, d), (0, DECODE_ROWS), programs, (sm, sm)))
            out.append(((d, d), (DECODE_ROWS + 1, ANY), (0, ANY), (sm, sm)))
    return out


def spec_index(type_name, d, rows, programs):
    return next(i for i, r in enumerate(spec_ranges(type_name))
                if all(lo <= v <= hi for v, (lo, hi) in zip((d, rows, programs), r)))
TYPE_NAMES = {FLOAT: "float", FLOAT16: "float16", BFLOAT16: "bfloat16"}
OP = "CausalAttention"


@pytest.fixture
def lib(native_library):
    return load(native_library)


def shapes(b, nq, nkv, s, t, d):
    return [[b, nq, s, d], [b, nkv, t, d], [b, nkv, t, d], [b, t]]


def plan(lib, inputs, masked_rows=0, elem_type=FLOAT16, arch=90):
    return plan_attrs(lib, OP, inputs, 1, (0.125, masked_rows), elem_type, arch)


def parse(msg):
    m = re.fullmatch(r"kernel=(\S+) arch=(\d+) grid=(\d+),(\d+),(\d+) block=(\d+) shared=(\d+) spec=(\d+)"
                     r"( grid2=(\d+),1,1 scratch=(\d+)( merge_counters=\d+)?)?(?: out\d+=\S+)*", msg)
    assert m, msg
    return [int(v) for v in m.groups()[1:8]]


def parse_split(msg):
    """(second grid, workspace bytes) of a split plan, None for one pass."""
    m = re.search(r" grid2=(\d+),1,1 scratch=(\d+)(?: merge_counters=\d+)?(?: out\d+=\S+)*$", msg)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_counters(msg):
    """The merge counters of a plan that merges in the chunks' launch (PHASE 3), 0 for two launches or one pass."""
    m = re.search(r" merge_counters=(\d+)", msg)
    return int(m.group(1)) if m else 0


@pytest.mark.parametrize("elem_type", [FLOAT, FLOAT16, BFLOAT16])
def test_table_holds_a_decode_and_a_prefill_spec_per_head_dim(lib, elem_type):
    i = next(i for i in range(lib.ort_triton_num_ops())
             if lib.ort_triton_op_name(i).decode() == OP and lib.ort_triton_op_type(i) == elem_type)
    msg = ctypes.create_string_buffer(1024)
    keys = []
    for s in range(lib.ort_triton_num_specs(i)):
        assert lib.ort_triton_spec_info(i, s, msg, len(msg)) == 0
        keys.append(re.match(r"kernel=causal_attention_fwd keys=(\S+)", msg.value.decode()).group(1))
    any_ = f"0:{ANY}"  # T: any, in the built-in specs
    want = [",".join(f"{lo}:{hi}" for lo, hi in r[:3]) + f",{any_},{r[3][0]}:{r[3][1]}"
            for r in spec_ranges(TYPE_NAMES[elem_type])]
    assert keys == want
    # a wide decode spec where one was measured: fp16 and bf16 at BLOCK_D 64 (ops/causal_attention.py, _WIDE_STAGES)
    assert (f"64:64,0:{DECODE_ROWS},{DECODE_WIDE}:{ANY},{any_},0:0" in keys) == (elem_type != FLOAT)


@pytest.mark.parametrize("elem_type", [FLOAT, FLOAT16, BFLOAT16])
@pytest.mark.parametrize("nq, nkv, s, t", [(32, 8, 1, 4096), (4, 1, 4, 9), (4, 1, 5, 9), (32, 8, 512, 512),
                                           (12, 12, 1, 100), (12, 12, 37, 70)])
@pytest.mark.parametrize("d", [64, 128])
def test_plan_packs_the_group_into_rows(lib, elem_type, nq, nkv, s, t, d):
    """rows = G * S picks the decode spec up to DECODE_ROWS; the grid is ceil(rows / BLOCK_M) * B * Nkv."""
    b = 3
    rc, msg = plan(lib, shapes(b, nq, nkv, s, t, d), elem_type=elem_type)
    assert rc == 0, msg
    arch, gx, gy, gz, block, shared, spec = parse(msg)
    rows = nq // nkv * s
    cfg = block_config(d, TYPE_NAMES[elem_type], rows, b * nkv)
    assert spec == spec_index(TYPE_NAMES[elem_type], d, rows, b * nkv)
    assert arch == 90 and (gy, gz) == (1, 1)
    programs = -(-rows // cfg["BLOCK_M"]) * b * nkv
    chunk = split_keys(t, programs, cfg["BLOCK_N"], cfg["SPLIT_TARGET"])
    chunks = split_chunks(t, chunk)
    assert gx == programs * chunks
    assert parse_split(msg) == ((programs, 4 * workspace_floats(programs, chunks, cfg["BLOCK_M"], cfg["BLOCK_D"]))
                                if chunk else None)
    # a split decode merges in the same launch (FUSED_MERGE, the decode default): one counter a row tile
    assert parse_counters(msg) == (programs if chunk and cfg["FUSED_MERGE"] and programs <= MERGE_COUNTERS else 0)
    assert block == 32 * cfg["num_warps"] and 0 < shared <= 227 * 1024


@pytest.mark.parametrize("b, nkv, t, chunks", [
    (1, 8, 4097, 11),    # Llama-1B, batch 1: 8 programs x 16 chunks stay under the target of 132: 257 -> 384 keys
    (1, 8, 1025, 5),     # 5 chunks of 256 (no chunk under SPLIT_MIN_KEYS)
    (4, 8, 4097, 4),     # 32 programs: 4 chunks; 1025 keys a chunk rounded up to 1152
    (1, 8, 256, 1),      # a cache of one chunk: one pass
    (1, 12, 4097, 11),   # GPT-2, batch 1: 12 programs x 11 chunks, one wave exactly
    (8, 8, 4097, 4),     # 64 programs, the wide spec (two waves, 264): 4 chunks
    (16, 8, 4097, 2),    # 128 programs: 2 chunks
    (8, 12, 4097, 2),    # 96 programs: 2 chunks, not 3 (288 programs would start a third, partial wave)
    (16, 12, 4097, 1),   # 192 programs: a second chunk would pass 264, so one pass
])
def test_decode_splits_the_cache_until_the_target(lib, b, nkv, t, chunks):
    """A decode step with few programs splits T into chunks of a multiple of BLOCK_N keys (the contract's
    split_keys, computed again in C): the first launch runs programs * chunks, the merge the programs."""
    rc, msg = plan(lib, shapes(b, 4 * nkv, nkv, 1, t, 64))
    assert rc == 0, msg
    cfg = block_config(64, "float16", 4, b * nkv)
    chunk = split_keys(t, b * nkv, cfg["BLOCK_N"], cfg["SPLIT_TARGET"])
    assert split_chunks(t, chunk) == chunks
    assert chunk % cfg["BLOCK_N"] == 0 and (not chunk or chunk >= SPLIT_MIN_KEYS)
    assert parse(msg)[1] == b * nkv * chunks
    assert (parse_split(msg) is None) == (chunks == 1)
    assert parse_counters(msg) == (b * nkv if chunks > 1 else 0)  # the decode default merges in the same launch


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 40), nkv=st.sampled_from([1, 2, 4, 8, 12, 16]), g=st.sampled_from([1, 4, 8]),
       t=st.integers(1, 20000), d=st.sampled_from([64, 128]))
def test_the_library_splits_as_the_contract(lib, b, nkv, g, t, d):
    """The C planner's chunk count equals split_keys' for any decode step: batch, KV heads, group, cache, head dim."""
    rc, msg = plan(lib, shapes(b, g * nkv, nkv, 1, t, d))
    assert rc == 0, msg
    cfg = block_config(d, "float16", g, b * nkv)
    programs = -(-g // cfg["BLOCK_M"]) * b * nkv
    chunk = split_keys(t, programs, cfg["BLOCK_N"], cfg["SPLIT_TARGET"])
    assert parse(msg)[1] == programs * split_chunks(t, chunk)


@pytest.mark.parametrize("elem_type", [FLOAT16, BFLOAT16])
def test_a_decode_step_of_many_programs_takes_the_wide_spec(lib, elem_type):
    """Llama-1B's decode (8 KV heads, head dim 64): batch 16 is 128 programs, past DECODE_WIDE, and takes the spec
    with one more stage (more shared memory a program) and a split up to two waves; batch 1 the other decode
    spec. Batch 8 and 16 split, their merge in the same launch."""
    plans = {}
    for b in (1, 16):
        rc, msg = plan(lib, shapes(b, 32, 8, 1, 4097, 64), elem_type=elem_type)
        assert rc == 0, msg
        plans[b] = parse(msg)
    assert plans[1][-1] == spec_index(TYPE_NAMES[elem_type], 64, 4, 8)
    assert plans[16][-1] == plans[1][-1] + 1 == spec_index(TYPE_NAMES[elem_type], 64, 4, 128)
    narrow, wide = block_config(64, "float16", 4, 8), block_config(64, "float16", 4, 128)
    assert (narrow["num_stages"], wide["num_stages"]) == (2, 3)
    assert (narrow["SPLIT_TARGET"], wide["SPLIT_TARGET"]) == (SPLIT_TARGET, 2 * SPLIT_TARGET)
    assert " merge_counters=64 " in plan(lib, shapes(8, 32, 8, 1, 4097, 64), elem_type=elem_type)[1]  # wide, split
    assert parse_counters(plan(lib, shapes(16, 32, 8, 1, 4097, 64), elem_type=elem_type)[1]) == 128
    assert plans[16][-2] > plans[1][-2]  # shared bytes: a third K/V stage


def test_prefill_never_splits(lib):
    rc, msg = plan(lib, shapes(1, 32, 8, 512, 512, 64))
    assert rc == 0 and parse_split(msg) is None, msg


@pytest.mark.parametrize("b, s, t", [(0, 4, 8), (2, 0, 8), (2, 0, 0)])
def test_empty_batch_or_queries_plan_an_empty_grid(lib, b, s, t):
    rc, msg = plan(lib, shapes(b, 8, 2, s, t, 64))
    assert rc == 0, msg
    assert parse(msg)[1] == 0


@pytest.mark.parametrize("masked_rows", [0, 1])
def test_both_meanings_of_rows_without_keys_plan(lib, masked_rows):
    rc, msg = plan(lib, shapes(2, 8, 2, 5, 9, 64), masked_rows=masked_rows)
    assert rc == 0, msg


@pytest.mark.parametrize(
    "inputs, masked_rows, expected",
    [
        (shapes(2, 4, 2, 5, 9, 48), 0,
         "ort_triton CausalAttention (float16): head dim 48 (dim 3 of input Q) is not supported; this library has "
         "kernels for head dims 32, 40, 64, 80, 96, 128"),
        (shapes(2, 4, 3, 5, 9, 64), 0,
         "input Q has 4 query heads and input K 3 key/value heads; the key/value heads must be at least 1 and divide"),
        (shapes(2, 4, 0, 5, 9, 64), 0, "input K 0 key/value heads"),
        (shapes(2, 4, 2, 5, 4, 64), 0, "input K holds T=4 keys (dim 2), fewer than the S=5 queries of input Q"),
        ([[2, 4, 5, 64], [2, 2, 9, 64], [2, 2, 8, 64], [2, 9]], 0,
         "input V has shape [2,2,8,64] but input K has shape [2,2,9,64]; they must be equal"),
        ([[2, 4, 5, 64], [3, 2, 9, 64], [3, 2, 9, 64], [3, 9]], 0,
         "input K has shape [3,2,9,64] but input Q has shape [2,4,5,64]; they must agree in batch"),
        ([[2, 4, 5, 64], [2, 2, 9, 32], [2, 2, 9, 32], [2, 9]], 0, "and head dim (dim 3)"),
        ([[2, 4, 5, 64], [2, 2, 9, 64], [2, 2, 9, 64], [2, 5]], 0,
         "input key_bias has shape [2,5]; it must be [2,9], [B, T] of inputs Q and K"),
        ([[2, 4, 5, 64], [2, 2, 9, 64], [2, 2, 9, 64], [2, 1, 1, 9]], 0, "input key_bias has shape [2,1,1,9]"),
        ([[2, 5, 256], [2, 2, 9, 64], [2, 2, 9, 64], [2, 9]], 0,
         "input Q has shape [2,5,256]; it must have rank 4, [B, Nq, S, D]"),
        ([[2, 4, 5, 64], [2, 9, 128], [2, 9, 128], [2, 9]], 0, "input K has shape [2,9,128]; it must have rank 4"),
        ([[2, 4, -1, 64], [2, 2, 9, 64], [2, 2, 9, 64], [2, 9]], 0, "input Q has a negative dimension"),
        (shapes(2, 4, 2, 5, 9, 64), 2, "attribute masked_rows=2 must be 0"),
        (shapes(1, 4, 2, 5, 1 << 25, 128), 0, "past this kernel's 32-bit indexing"),
        (shapes(1, 1 << 20, 1, 1 << 12, 1 << 12, 64), 0, "past this kernel's 32-bit indexing"),
        (shapes(1 << 18, 64, 64, 1 << 14, 1 << 14, 64), 0,
         f"the launch needs ceil(G * S / {PREFILL_M}) * B * Nkv = {(1 << 14) // PREFILL_M} * 262144 * 64 programs, "
         "more than the 2147483647"),
    ],
)
def test_plan_errors(lib, inputs, masked_rows, expected):
    rc, msg = plan(lib, inputs, masked_rows=masked_rows)
    assert rc != 0 and expected in msg, msg


def test_missing_key_bias_is_refused(lib):
    msg = ctypes.create_string_buffer(1024)
    rc = lib.ort_triton_plan_attrs(OP.encode(), FLOAT16, 90, 4, (ctypes.c_int * 4)(1, 1, 1, 0),
                                   (ctypes.c_int * 4)(4, 4, 4, 0),
                                   (ctypes.c_int64 * 12)(2, 4, 5, 64, *[2, 2, 9, 64] * 2), 1, 2,
                                   (ctypes.c_double * 2)(0.125, 0), msg, len(msg))
    assert rc != 0 and "required input key_bias is missing" in msg.value.decode()
