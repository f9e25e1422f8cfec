"""Decoder exports with a KV cache (ort_triton/decoders.py), both torch exporters: on ORT CPU, fp32, a
prefill (past length 0) gives the torch model's logits and cache, a decode step fed that cache gives the
torch model's next step, a prefill on top of a past (chunked prefill) gives the torch wrapper's, and greedy
decoding gives `model.generate`'s tokens, left padding included. Each model is exported once per module.
"""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ort_triton import decoders

TINY = ("llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "gemma-tiny", "gpt2-tiny", "phi-tiny")
CASES = [(m, e, None) for m in TINY for e in decoders.EXPORTERS] + [("llama-tiny", "dynamo", 23)]
RTOL = 1e-4


def rel_err(got, want) -> float:
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else want
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def models():
    return {}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory, models):
    """(name, exporter, opset, cache) -> (model, session, path); each exported once per module."""
    made = {}

    def get(name, exporter, opset=None, cache=True):
        key = (name, exporter, opset, cache)
        if key not in made:
            model = models.setdefault(name, decoders.build(name))
            path = tmp_path_factory.mktemp("dec") / f"{name}-{exporter}-{opset}-{cache}.onnx"
            decoders.export(model, path, exporter=exporter, cache=cache, opset=opset)
            made[key] = model, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), path
        return made[key]

    return get


def test_names_and_sample_inputs():
    model = decoders.build("llama-tiny")
    layers, kv, head_dim = decoders.cache_spec(model)
    assert (layers, kv, head_dim) == (2, 2, 32)
    feeds = decoders.sample_inputs(model, batch=3, seq=4, past=0, left_pad=2)
    assert list(feeds) == decoders.input_names(model) == ["input_ids", "attention_mask", "past_key_0",
                                                          "past_value_0", "past_key_1", "past_value_1"]
    assert feeds["past_key_1"].shape == (3, kv, 0, head_dim) and feeds["past_key_1"].dtype == np.float32
    assert feeds["attention_mask"].tolist() == [[1] * 4, [1] * 4, [0, 0, 1, 1]]
    with pytest.raises(ValueError, match="left_pad"):
        decoders.sample_inputs(model, seq=2, past=1, left_pad=3)
    with pytest.raises(ValueError, match="unknown model"):
        decoders.build("llama-huge")


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter, opset", CASES, ids=lambda v: str(v))
def test_prefill_then_decode_equal_torch(sessions, name, exporter, opset):
    model, sess, path = sessions(name, exporter, opset)
    outputs = decoders.output_names(model)
    if opset == 23:  # what the rules for opset 23 rely on: the exporter emits ONNX's own fused ops
        ops = collections.Counter(n.op_type for n in onnx.load(path).graph.node)
        layers = model.config.num_hidden_layers
        assert ops["Attention"] == layers and ops["RotaryEmbedding"] == 2 * layers, ops
        assert ops["RMSNormalization"] == 2 * layers + 1 and ops["Softmax"] == 0, ops
    # prefill: P = 0, the HF model on its own (default positions = what the graph derives from a full mask)
    feeds = decoders.sample_inputs(model, batch=2, seq=7, past=0, seed=1)
    ids, mask = (torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask"))
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, use_cache=True)
    got = dict(zip(outputs, sess.run(outputs, feeds)))
    assert rel_err(got["logits"], ref.logits) < RTOL
    for i, layer in enumerate(decoders.output_cache(ref).layers):
        assert rel_err(got[f"present_key_{i}"], layer.keys) < RTOL
        assert rel_err(got[f"present_value_{i}"], layer.values) < RTOL
    # decode: S = 1, past = the ORT presents; torch continues from its own cache
    token = got["logits"][:, -1].argmax(-1)[:, None]
    step = {"input_ids": token, "attention_mask": np.ones((2, 8), np.int64)}
    step |= {n.replace("present", "past"): v for n, v in got.items() if n.startswith("present")}
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(token), attention_mask=torch.ones(2, 8, dtype=torch.long),
                    cache=ref.cache, use_cache=True)
    got = dict(zip(outputs, sess.run(outputs, step)))
    assert got["logits"].shape == (2, 1, model.config.vocab_size)
    assert rel_err(got["logits"], ref.logits) < RTOL
    for i, layer in enumerate(decoders.output_cache(ref).layers):
        assert got[f"present_key_{i}"].shape[2] == 8
        assert rel_err(got[f"present_key_{i}"], layer.keys) < RTOL
        assert rel_err(got[f"present_value_{i}"], layer.values) < RTOL


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter, opset", CASES, ids=lambda v: str(v))
def test_prefill_on_past_with_left_padding_equals_torch(sessions, name, exporter, opset):
    """S > 1 on a random past, the last row left-padded over the past and its first new token. Positions
    whose query sees no key at all (padding) are garbage that the exporters write differently (dynamo's
    mask is finfo.min, not -inf): compared only on real tokens."""
    model, sess, _ = sessions(name, exporter, opset)
    outputs = decoders.output_names(model)
    past, seq, pad = 3, 4, 4
    feeds = decoders.sample_inputs(model, batch=3, seq=seq, past=past, seed=2, left_pad=pad)
    with torch.no_grad():
        ref = decoders.wrap(model)(*(torch.from_numpy(v) for v in feeds.values()))
    got = sess.run(outputs, feeds)
    real = feeds["attention_mask"][:, past:].astype(bool)  # [B, S] query positions that are tokens
    assert rel_err(got[0][real], ref[0].numpy()[real]) < RTOL
    for g, r in zip(got[1:], ref[1:]):
        assert g.shape == (3, decoders.cache_spec(model)[1], past + seq, decoders.cache_spec(model)[2])
        r = r.numpy()
        assert rel_err(g[:, :, :past], r[:, :, :past]) == 0  # the past is copied through
        for b in range(3):
            keep = real[b]
            assert rel_err(g[b, :, past:][:, keep], r[b, :, past:][:, keep]) < RTOL


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter, opset", CASES, ids=lambda v: str(v))
def test_greedy_tokens_equal_generate(sessions, name, exporter, opset):
    model, sess, _ = sessions(name, exporter, opset)
    rng = np.random.default_rng(3)
    ids = rng.integers(1, model.config.vocab_size, (2, 6))
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # left padding, as a batched prompt has it
    steps = 16
    got = decoders.greedy(sess, model.config, ids, steps, attention_mask=mask)
    with torch.no_grad():
        want = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=steps,
                              do_sample=False)[:, ids.shape[1]:].numpy()
    assert got.shape == (2, steps)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("exporter", decoders.EXPORTERS)
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_no_cache_export_equals_torch(sessions, name, exporter):
    model, sess, _ = sessions(name, exporter, cache=False)
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask"]
    for batch, seq in ((1, 1), (3, 9)):
        feeds = decoders.sample_inputs(model, batch, seq, 0, seed=seq, cache=False)
        with torch.no_grad():
            want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits
        (got,) = sess.run(None, feeds)
        assert rel_err(got, want) < RTOL
