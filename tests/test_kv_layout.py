"""The sequence-major cache layout (ort_triton/ops/kv_layout.py): each op that writes or reads the cache, given
seq_major = 1 and its cache tensors sequence first, computes what it computes heads first, its function body on
ORT CPU as its reference does, at the opsets the bodies support."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ort_triton.ops.causal_attention import CAUSAL_ATTENTION
from ort_triton.ops.kv_layout import TO_SEQ
from ort_triton.ops.qkv_cache import QKV_CACHE
from ort_triton.ops.qkv_rotary_cache import QKV_NORM_ROTARY_CACHE, QKV_ROTARY_CACHE
from tests.test_contract import CASES, _single_node_model, _typed

RNG = np.random.default_rng(1)
# CausalAttention: Q [2, 4, 3, 8], K, V [2, 2, 7, 8] (GQA 2:1, 4 past positions), a padded key
_BIAS = np.zeros((2, 7))
_BIAS[1, 0] = -np.inf
ATTENTION_CASE = ([RNG.normal(size=(2, 4, 3, 8)), RNG.normal(size=(2, 2, 7, 8)), RNG.normal(size=(2, 2, 7, 8)), _BIAS],
                  {"scale": 0.35, "masked_rows": 0})
# which inputs and outputs are cache tensors, by op
CACHE_IO = {QKV_ROTARY_CACHE: ((3, 4), (1, 2)), QKV_NORM_ROTARY_CACHE: ((3, 4), (1, 2)), QKV_CACHE: ((2, 3), (1, 2)),
            CAUSAL_ATTENTION: ((1, 2), ())}


def _case(op):
    return ATTENTION_CASE if op is CAUSAL_ATTENTION else CASES[op]


@pytest.mark.parametrize("opset", [15, 18, 23])
@pytest.mark.parametrize("op", list(CACHE_IO), ids=lambda op: op.name)
def test_seq_major_is_the_heads_first_op_relaid(op, opset):
    inputs, attrs = _case(op)
    inputs = _typed(op, inputs)
    cache_in, cache_out = CACHE_IO[op]
    relaid = [a.transpose(TO_SEQ) if i in cache_in else a for i, a in enumerate(inputs)]
    want = [w.transpose(TO_SEQ) if i in cache_out else w for i, w in enumerate(op.reference(*inputs, **attrs))]
    ref = op.reference(*relaid, **attrs, seq_major=1)
    for r, w in zip(ref, want):
        np.testing.assert_allclose(r, w, rtol=1e-12, atol=1e-12)
    m = _single_node_model(op, relaid, {**attrs, "seq_major": 1}, opset)
    onnx.checker.check_model(m)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {f"in{i}": a for i, a in enumerate(relaid)})
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert np.abs(g - w).max() / np.abs(w).max() < 1e-5


@pytest.mark.parametrize("op", list(CACHE_IO), ids=lambda op: op.name)
def test_heads_first_body_is_unchanged_by_the_attribute(op):
    """seq_major = 0 (the default) runs the body's other If branch: the heads-first result, as before."""
    inputs, attrs = _case(op)
    inputs = _typed(op, inputs)
    m = _single_node_model(op, inputs, attrs, 17)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {f"in{i}": a for i, a in enumerate(inputs)})
    for g, w in zip(got, op.reference(*inputs, **attrs)):
        assert np.abs(g - w).max() / np.abs(w).max() < 1e-5
