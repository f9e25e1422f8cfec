"""On the GPU: the CausalAttention kernel through Triton's JIT against torch's sdpa in float32, one node on
ORT's CUDA EP with the library against the float64 reference, and a rewritten tiny decoder (prefill and
decode steps) on the CUDA EP against the original on ORT CPU.

Shapes cover decode (S = 1 over long caches, the G heads of a KV head packed into one program), prefill
(S = T), chunks over a past (S < T), GQA 4:1 and 8:1, MHA, every head dim the library holds; left padding,
with rows that see no key in both meanings the contract defines. `ort_triton_launches` proves the
Triton kernel ran, not the function body.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import graph_rewrites
from ort_triton import decoders
from ort_triton.contract import DOMAIN
from ort_triton.kernels.causal_attention import causal_attention
from ort_triton.ops.causal_attention import CAUSAL_ATTENTION, CAUSAL_HEAD_DIMS, reference_causal_attention
from ort_triton.runtime import launch_count, make_session

pytestmark = pytest.mark.gpu

OPSET = 18
DTYPES = {"float": (TensorProto.FLOAT, torch.float32, 1e-4), "float16": (TensorProto.FLOAT16, torch.float16, 1e-2),
          "bfloat16": (TensorProto.BFLOAT16, torch.bfloat16, 2e-2)}
# (B, Nq, Nkv, S, T, D)
SHAPES = [(1, 32, 8, 1, 4096, 64), (4, 32, 8, 1, 777, 64), (8, 16, 2, 1, 129, 128), (2, 12, 12, 1, 300, 64),
          (2, 32, 8, 512, 512, 64), (3, 8, 2, 37, 37, 128), (2, 8, 8, 100, 100, 80), (2, 16, 4, 7, 1030, 96),
          (2, 8, 1, 129, 300, 32), (1, 4, 4, 1, 1, 40),
          # decode with B * Nkv >= DECODE_WIDE: the wide decode spec (one more stage) at BLOCK_D 64
          (16, 32, 8, 1, 1025, 64), (6, 12, 12, 1, 333, 40),
          # Gemma's head dim 256: MQA decode over a split cache, a prefill, a chunk over a past
          (1, 8, 1, 1, 1500, 256), (2, 8, 1, 200, 200, 256), (2, 4, 2, 19, 90, 256)]


def _inputs(b, nq, nkv, s, t, d, dtype, pad, seed):
    """Q, K, V rounded to dtype (as float64 numpy for the reference) and key_bias with -inf on the first
    `pad[i]` keys of row i (left padding)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for shape in
               ((b, nq, s, d), (b, nkv, t, d), (b, nkv, t, d)))
    kb = torch.zeros(b, t)
    for i, p in enumerate(pad):
        kb[i, :p] = float("-inf")
    return q, k, v, kb.to(dtype)


def _pads(b, s, t):
    """Row 0 unpadded; row 1 padded past its first queries' view (they see no key); row 2 a few keys."""
    return [0, t - s + min(2, s - 1) + 1, 3][:b]


@pytest.mark.parametrize("type_name", list(DTYPES))
@pytest.mark.parametrize("b, nq, nkv, s, t, d", SHAPES, ids=lambda x: str(x))
def test_kernel_matches_torch_sdpa(type_name, b, nq, nkv, s, t, d):
    """Rows with at least one key against torch's sdpa (float32, GQA by repeat_interleave, the causal +
    padding mask as a boolean); rows with none against the contract (0, or the mean of V)."""
    _, dtype, tol = DTYPES[type_name]
    q, k, v, kb = _inputs(b, nq, nkv, s, t, d, dtype, _pads(b, s, t), seed=s + t + d)
    for masked_rows in (0, 1):
        y = causal_attention(q.cuda(), k.cuda(), v.cuda(), kb.cuda(), d**-0.5, masked_rows).float().cpu()
        g = nq // nkv
        visible = torch.arange(t)[None, :] <= (t - s + torch.arange(s))[:, None]
        allowed = visible[None, None] & (kb.float() == 0)[:, None, None, :]  # [B, 1, S, T]
        with torch.no_grad():
            want = torch.nn.functional.scaled_dot_product_attention(
                q.float().cuda(), k.float().repeat_interleave(g, 1).cuda(), v.float().repeat_interleave(g, 1).cuda(),
                attn_mask=allowed.cuda(), scale=d**-0.5).cpu()
        want = want.transpose(1, 2).reshape(b, s, nq * d)
        seen = allowed.any(-1)[:, 0]  # [B, S]
        assert torch.isfinite(y).all()
        err = (y - want)[seen].abs().max() / want[seen].abs().max()
        assert err < tol, f"rel err {err:.2e}"
        blind = y[~seen]
        if masked_rows == 0:
            assert (blind == 0).all()
        elif blind.numel():
            mean = v.float().mean(2).repeat_interleave(g, 1)  # [B, Nq, D]
            rows = mean[:, None].expand(b, s, nq, d).reshape(b, s, nq * d)[~seen]
            assert (blind - rows).abs().max() <= tol * rows.abs().max()


def _node_model(type_name, masked_rows, scale):
    t = DTYPES[type_name][0]
    names = ["Q", "K", "V", "key_bias"]
    shapes = [["b", "nq", "s", "d"], ["b", "nkv", "t", "d"], ["b", "nkv", "t", "d"], ["b", "t"]]
    nodes = [helper.make_node("Cast", [n + "32"], [n], to=t) for n in names]
    nodes += [helper.make_node(CAUSAL_ATTENTION.name, names, ["y"], domain=DOMAIN, scale=scale,
                               masked_rows=masked_rows),
              helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT)]
    g = helper.make_graph(nodes, "causal", [helper.make_tensor_value_info(n + "32", TensorProto.FLOAT, s)
                                            for n, s in zip(names, shapes)],
                          [helper.make_tensor_value_info("y32", TensorProto.FLOAT, ["b", "s", "h"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                          functions=[CAUSAL_ATTENTION.function_proto(OPSET)], ir_version=9)
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("type_name", list(DTYPES))
@pytest.mark.parametrize("masked_rows", [0, 1])
def test_cuda_ep_runs_the_kernel(gpu_library, type_name, masked_rows):
    """One session (dynamic shapes) over every head dim and a decode, prefill and chunk shape each; the
    decodes over 300 and 2000 keys split the cache (2 and 4-5 chunks in fp16: the workspace from ORT's arena),
    the one of 16 x 8 KV heads runs the wide decode spec at BLOCK_D 64 (DECODE_WIDE programs and more), its 257
    keys in 2 chunks at head dims 40 and 64."""
    _, dtype, tol = DTYPES[type_name]
    sess = make_session(_node_model(type_name, masked_rows, 0.1), providers=["CUDAExecutionProvider"],
                        library=gpu_library)
    for d in CAUSAL_HEAD_DIMS:
        for b, nq, nkv, s, t in ((4, 8, 2, 1, 300), (2, 8, 2, 65, 65), (3, 4, 1, 17, 90), (3, 32, 8, 1, 2000),
                                 (16, 32, 8, 1, 257)):
            q, k, v, kb = _inputs(b, nq, nkv, s, t, d, dtype, _pads(b, s, t), seed=d + s)
            feeds = {n + "32": x.float().numpy() for n, x in zip(["Q", "K", "V", "key_bias"], (q, k, v, kb))}
            before = launch_count(gpu_library)
            (got,) = sess.run(None, feeds)
            assert launch_count(gpu_library) == before + 1, "the Triton kernel did not run"
            (want,) = reference_causal_attention(*(x.double().numpy() for x in (q, k, v, kb)), 0.1, masked_rows)
            assert np.isfinite(got).all()
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < tol, (d, b, nq, nkv, s, t, err)


def test_bad_shapes_are_an_ort_error_and_the_next_run_works(gpu_library):
    sess = make_session(_node_model("float", 0, 0.125), providers=["CUDAExecutionProvider"], library=gpu_library)
    feeds = lambda nkv, t: {"Q32": np.ones((2, 4, 3, 64), np.float32), "K32": np.ones((2, nkv, t, 64), np.float32),
                            "V32": np.ones((2, nkv, t, 64), np.float32), "key_bias32": np.zeros((2, t), np.float32)}
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"ort_triton CausalAttention \(float\): input Q has 4 query heads and input K 3"):
        sess.run(None, feeds(3, 5))
    (y,) = sess.run(None, feeds(2, 5))
    np.testing.assert_allclose(y, 1.0, rtol=1e-6)


DECODERS = [("llama-tiny", "dynamo", "sdpa"), ("llama-tiny", "torchscript", "sdpa"), ("gpt2-tiny", "dynamo", "eager"),
            ("gemma-tiny", "dynamo", "sdpa")]  # head dim 256


@pytest.mark.parametrize("name, exporter, impl", DECODERS)
def test_rewritten_decoder_generates_on_cuda(gpu_library, tmp_path, name, exporter, impl):
    """A left-padded prefill and decode steps on the CUDA EP with the library, against the original on ORT
    CPU (fp32; 3xTF32 dots and other summation orders: 1e-4), and the same greedy tokens."""
    model = decoders.build(name, attn_implementation=impl)
    path = decoders.export(model, tmp_path / "m.onnx", exporter=exporter)
    optimized = graph_rewrites.optimize(str(path))
    layers = decoders.cache_spec(model)[0]
    assert sum(n.op_type == "CausalAttention" for n in optimized.graph.node) == layers
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ours = make_session(optimized, providers=[("CUDAExecutionProvider", {"use_tf32": "0"})], library=gpu_library)
    for batch, seq, past, pad in ((3, 9, 0, 4), (3, 1, 20, 6), (2, 5, 11, 3)):
        feeds = decoders.sample_inputs(model, batch, seq, past, seed=seq, left_pad=pad)
        before = launch_count(gpu_library)
        got = ours.run(None, feeds)
        assert launch_count(gpu_library) - before >= layers
        want = ref.run(None, feeds)
        for g, w in zip(got, want):
            assert np.isfinite(g).all()
            assert np.abs(g - w).max() / np.abs(w).max() < 1e-4
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 6))
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    np.testing.assert_array_equal(decoders.greedy(ours, model.config, ids, 8, mask),
                                  decoders.greedy(ref, model.config, ids, 8, mask))
