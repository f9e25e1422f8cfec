"""Tuning candidates beyond the built-in configs. The warp-specialised attention kernel (ops/attention.py
`ws_supported`), experimental: refused everywhere unless ORT_TRITON_EXPERIMENTAL_WS=1 (its first launch did not
return on the H200); with it, offered on Hopper only, for what it compiles for, and a table entry that asks it of
an older GPU is refused. CausalAttention's fused merge (FUSED_MERGE: the split decode in one launch), the decode
default. A library built with both holds the WS kernel for sm_90 with what its launch needs (three warp groups,
Triton's global scratch a program, which the native compute takes from ORT's arena), dispatched for its bucket on
sm_90 only, and plans the fused merge with its counters (one a row tile). The GPU runs
(tests/gpu/test_attention_ws_ort.py, tests/gpu/test_causal_attention_gpu.py) check their outputs through ORT."""

import ctypes
import json

import pytest

from ort_triton import tuning
from ort_triton.ops import BY_NAME
from ort_triton.ops.attention import WS_ENV
from tests import native_hooks
from tests.conftest import run_cli

MHA, PACKED = BY_NAME["MultiHeadAttention"], BY_NAME["PackedMultiHeadAttention"]


def ws_configs(op, type_name, keys, arch):
    return [c for c in op.tuning.candidates(type_name, keys, arch) if c.get("WS")]


@pytest.fixture
def ws_on(monkeypatch):
    monkeypatch.setenv(WS_ENV, "1")  # subprocesses (the CLI, the tuner's workers) inherit it


def test_off_unless_asked_for(monkeypatch, tmp_path):
    """Without the variable: no WS candidate, and a table with a WS entry is refused, naming the variable."""
    monkeypatch.delenv(WS_ENV, raising=False)
    assert not ws_configs(MHA, "float16", (64, 1, 2048, 96), 90)
    assert not ws_configs(PACKED, "float16", (64, 1, 2048, 96), 90)
    assert MHA.tuning.candidates("float16", (64, 1, 2048, 96), 90)  # the others stay
    with pytest.raises(tuning.TuningError, match=f"experimental.*set {WS_ENV}=1"):
        tuning.load(_table(tmp_path / "t.json", 90, BUCKET, WS))


def test_offered_on_hopper_for_what_it_compiles(ws_on):
    aligned = (64, 1, 2048, 96)  # head dim, Sq and Skv multiples of 16, Sq, B * N
    configs = ws_configs(MHA, "float16", aligned, 90)
    assert {(c["BLOCK_N"], c["num_stages"]) for c in configs} == {(64, 2), (64, 3), (128, 2), (128, 3)}
    assert all(c["BLOCK_M"] == 128 and c["num_warps"] == 4 for c in configs)
    assert ws_configs(PACKED, "bfloat16", aligned, 90) == configs
    assert ws_configs(PACKED, "float16", (32, 1, 128, 12), 90)
    assert ws_configs(MHA, "float16", (128, 1, 128, 12), 90)
    # not before Hopper, not fp32, not an unaligned bucket, not head dim 40, not packed at 128
    refused = [(MHA, "float16", aligned, 80), (MHA, "float16", aligned, 89), (MHA, "float", aligned, 90),
               (MHA, "float16", (64, 0, 2048, 96), 90), (MHA, "float16", (40, 1, 2048, 96), 90),
               (PACKED, "float16", (128, 1, 128, 12), 90)]
    for op, type_name, keys, arch in refused:
        assert not ws_configs(op, type_name, keys, arch), (op.name, type_name, keys, arch)


def _table(path, arch, keys, config, more=()):
    path.write_text(json.dumps({"format": tuning.FORMAT, "arch": arch, "entries": [
        {"op": "MultiHeadAttention", "type": "float16", "arch": arch, "keys": keys, "config": config,
         "builtin": False}, *more]}))
    return path


WS = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, WS=1)
BUCKET = [[64, 64], [1, 1], [257, 512], [9, 16]]  # head dim 64, aligned, Sq 257..512, B * N 9..16
# Llama-1B's decode at batch 1 over 1024 keys: head dim 64, G * S = 4 rows, B * Nkv = 8, T 513..1024
FUSED = {"op": "CausalAttention", "type": "float16", "arch": 90, "builtin": False,
         "keys": [[64, 64], [3, 4], [5, 8], [513, 1024]],
         "config": dict(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=2, SPLIT_TARGET=128, FUSED_MERGE=1)}


def test_an_entry_for_an_older_gpu_is_refused(ws_on, tmp_path):
    with pytest.raises(tuning.TuningError, match="for sm_90 on, not sm_80"):
        tuning.load(_table(tmp_path / "t.json", 80, BUCKET, WS))
    with pytest.raises(tuning.TuningError, match="Sq, Skv multiples of 16"):
        tuning.load(_table(tmp_path / "t.json", 90, [[64, 64], [0, 1], [257, 512], [9, 16]], WS))


def _plan(lib, b, s, heads, d, arch):
    hidden = heads * d
    return native_hooks.plan_fields(lib, "MultiHeadAttention", [[b, s, hidden]] * 3 + [[b, s], [hidden], [hidden]], 1,
                                    [heads, d**-0.5], native_hooks.FLOAT16, arch)


@pytest.mark.slow
def test_build_holds_the_kernel_with_its_scratch(ws_on, tmp_path):
    """Built for sm_80 and sm_90 (the built-in kernels are cached by tests/aot's default-arch build in CI)."""
    table = _table(tmp_path / "t.json", 90, BUCKET, WS, [FUSED])
    res = run_cli("build", "--arch", "80,90", "--tuning", table, "-o", tmp_path / "lib", timeout=1800)
    assert "2 tuned spec(s) of 2 entries" in res.stdout, res.stdout
    lib = native_hooks.load(tmp_path / "lib" / "libort_triton.so")
    op = next(i for i in range(lib.ort_triton_num_ops()) if lib.ort_triton_op_name(i) == b"MultiHeadAttention"
              and lib.ort_triton_op_type(i) == native_hooks.FLOAT16)
    info = ctypes.create_string_buffer(512)
    assert lib.ort_triton_spec_info(op, 0, info, 512) == 0
    assert info.value.decode().endswith("keys=64:64,1:1,257:512,9:16 archs=90")

    tuned = _plan(lib, 1, 512, 12, 64, 90)  # BERT-base at 1x512: 4 query blocks x 12 heads
    assert tuned["spec"] == "0" and tuned["block"] == str(3 * 4 * 32)  # a producer and two consumer groups
    assert int(tuned["shared"]) > 48 * 1024  # set past the default limit at load
    programs = 4 * 12
    assert int(tuned["triton_scratch"]) % programs == 0 and int(tuned["triton_scratch"]) // programs >= 128
    # on sm_80, and for a shape outside the bucket, the built-in spec: no scratch
    for other in (_plan(lib, 1, 512, 12, 64, 80), _plan(lib, 1, 1024, 12, 64, 90)):
        assert other["spec"] != "0" and "triton_scratch" not in other and other["block"] != "384"

    # the fused merge: the two launches' plan, offered as one over a counter a row tile (8 KV heads, 4 chunks)
    fused = native_hooks.plan_fields(lib, "CausalAttention", [[1, 32, 1, 64], [1, 8, 1024, 64], [1, 8, 1024, 64],
                                                              [1, 1024]], 1, [0.125, 0], native_hooks.FLOAT16, 90)
    assert fused["spec"] == "0" and fused["grid"] == "32,1,1" and fused["grid2"] == "8,1,1"
    assert fused["merge_counters"] == "8"
    rc, msg = native_hooks.plan_attrs(lib, "CausalAttention", [[1, 32, 1, 64], [1, 8, 1024, 64], [1, 8, 1024, 64],
                                                               [1, 1024]], 1, [0.125, 0], native_hooks.FLOAT16, 80)
    # the built-in spec on sm_80: the decode default merges in the same launch too
    assert rc == 0 and " spec=0 " not in msg and "grid2=8,1,1 " in msg and "merge_counters=8" in msg, msg

    # a head dim nothing holds: the message lists each head dim once, the tuned spec's 64 ahead of the built-ins
    rc, msg = native_hooks.plan_attrs(lib, "MultiHeadAttention", [[2, 8, 12]] * 3 + [[2, 8], [12], [12]], 1,
                                      [1, 1.0], native_hooks.FLOAT16, 90)
    assert rc != 0 and "kernels for head dims 64, 32, 40, 80, 96, 128 (" in msg, msg


@pytest.mark.slow
def test_tune_times_the_ws_candidates_and_keeps_the_winner(ws_on, tmp_path):
    """A float16 PackedMultiHeadAttention node at S = 16 (aligned): the tuner runs every candidate (under the
    interpreter here, the WS ones through their TMA descriptors), a scripted timer makes the first WS one the
    fastest, and the table's entry is that config, which loads as a spec for sm_90 on."""
    import onnx

    from ort_triton import tune
    from ort_triton.ops.packed_attention import PACKED_MULTI_HEAD_ATTENTION
    from tests.gpu.test_attention_ort import _node_model

    heads, d = 2, 32
    h = heads * d
    model = _node_model(PACKED_MULTI_HEAD_ATTENTION, "float16", ["qkv", "key_bias", "bias"],
                        [["b", "s", 3 * h], ["b", "s"], [3 * h]], ["b", "s", h], heads, d**-0.5)
    onnx.save(model, tmp_path / "packed.onnx")
    candidates = PACKED.tuning.candidates("float16", (d, 1, 16, 2), 90)
    first_ws = next(i for i, c in enumerate(candidates) if c.get("WS"))
    times = iter([0.5 if i == first_ws else 1.0 for i in range(len(candidates))])

    def timer(fn):
        fn()
        return next(times)

    out = tune.tune(tmp_path / "packed.onnx", [(1, 16)], device="cpu", arch=90, timer=timer,
                    ops=("PackedMultiHeadAttention",), log=lambda s: None)
    (entry,) = json.loads(out.read_text())["entries"]
    assert entry["config"] == candidates[first_ws] and not entry["builtin"] and not entry["skipped"]
    (loaded,) = tuning.load(out)[1]
    spec = loaded.spec()
    assert spec.constexprs["WS"] is True and spec.constexprs["PACKED"] is True and spec.min_arch == 90
