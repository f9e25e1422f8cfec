"""The EmbedLayerNorm kernel (under Triton's interpreter on CPU) against the float64 reference: every
element type, odd H and token counts, every broadcast form of the ids, poisoned outputs, and out-of-range
ids, which must give NaN on their token's row and nowhere else."""

import numpy as np
import pytest
import torch

from ort_triton.kernels.embed_layer_norm import embed_layer_norm
from ort_triton.ops.embed_layer_norm import EMBED_LAYER_NORM, layout

DTYPES = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def _case(batch, seq, h, dtype, shapes=((None, None), (1, None), (1, None)), vocab=(50, 2, 40), seed=0):
    """Inputs for one call: ids of the given [B', S'] shapes (None: B or S), tables of `vocab` rows."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, v, (batch if b is None else b, seq if s is None else s), generator=g)
           for v, (b, s) in zip(vocab, shapes)]
    tables = [torch.randn(v, h, generator=g).to(dtype) for v in vocab]
    gamma = (1 + 0.3 * torch.randn(h, generator=g)).to(dtype)
    beta = (0.3 * torch.randn(h, generator=g)).to(dtype)
    return [*ids, *tables, gamma, beta]


def _reference(args, eps):
    return EMBED_LAYER_NORM.reference(*[a.float().numpy() if a.is_floating_point() else a.numpy() for a in args],
                                      epsilon=eps)[0]


def _poisoned(batch, seq, h, dtype):
    return torch.full((batch, seq, h), float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("batch, seq, h", [(2, 7, 64), (3, 5, 37), (1, 1, 1), (2, 3, 1000), (1, 9, 1024),
                                           (1, 2, 3000)])
def test_kernel_matches_reference(dtype, batch, seq, h):
    args = _case(batch, seq, h, dtype)
    y = embed_layer_norm(*args, epsilon=1e-12, out=_poisoned(batch, seq, h, dtype))  # every element written
    want = _reference(args, 1e-12)
    assert y.shape == (batch, seq, h) and not torch.isnan(y).any()
    assert np.abs(y.float().numpy() - want).max() <= DTYPES[dtype] * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("shapes", [
    ((None, None), (None, None), (None, None)),  # RoBERTa: position ids computed per batch row
    ((None, None), (1, None), (1, None)),  # BERT: token types and positions from [1, S] buffers
    ((None, None), (1, 1), (1, None)),  # DistilBERT: the rule's [1, 1] zero id for its zero table
    ((None, None), (None, 1), (1, 1)),
    ((1, None), (None, 1), (1, None)),  # input_ids broadcast too: [B, S] is the ids' broadcast
], ids=lambda s: "x".join(f"{b or 'B'}{s or 'S'}" for b, s in s))
def test_broadcast_forms(shapes):
    args = _case(3, 6, 48, torch.float32, shapes=shapes, seed=1)
    y = embed_layer_norm(*args, epsilon=1e-5)
    assert y.shape == (3, 6, 48)
    np.testing.assert_allclose(y.numpy(), _reference(args, 1e-5), rtol=0, atol=2e-5)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_rows_per_program(rows):
    """Several tokens a program, with a token count that leaves the last program part empty."""
    args = _case(1, 7, 96, torch.float32, seed=2)
    y = embed_layer_norm(*args, config=(rows, 2))
    np.testing.assert_allclose(y.numpy(), _reference(args, 1e-12), rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_out_of_range_id_gives_nan_on_its_row_only(dtype):
    args = _case(2, 5, 40, dtype, shapes=((None, None), (None, None), (1, None)), vocab=(30, 2, 8), seed=3)
    args[0][0, 1] = 30  # one past the word table
    args[1][1, 4] = -3  # before the start of the token-type table (V = 2)
    args[2][0, 2] = 99  # a position: [1, S], so column 2 of every batch row
    args[0][1, 0] = -30  # in range: counts from the end, as Gather's
    y = embed_layer_norm(*args, out=_poisoned(2, 5, 40, dtype)).float().numpy()
    bad = np.zeros((2, 5), bool)
    bad[0, 1] = bad[1, 4] = bad[0, 2] = bad[1, 2] = True
    assert np.isnan(y[bad]).all()
    assert not np.isnan(y[~bad]).any()
    want = _reference(args, 1e-12)
    assert np.isnan(want[bad]).all()
    assert np.abs(y[~bad] - want[~bad]).max() <= DTYPES[dtype] * max(1.0, np.abs(want[~bad]).max())


def test_negative_ids_read_from_the_end():
    args = _case(2, 4, 32, torch.float32, seed=4)
    neg = [a.clone() for a in args]
    neg[0] = args[0] - 50  # the word table has 50 rows: -50..-1 are rows 0..49
    np.testing.assert_array_equal(embed_layer_norm(*neg).numpy(), embed_layer_norm(*args).numpy())


def test_layout_is_one_power_of_two_block():
    assert layout(768) == {"BLOCK_H": 1024} and layout(1) == {"BLOCK_H": 256} and layout(16384) == {"BLOCK_H": 16384}


def test_refuses_what_the_contract_does_not_take():
    args = _case(2, 3, 16, torch.float32)
    with pytest.raises(ValueError, match="int64"):
        embed_layer_norm(args[0].int(), *args[1:])
    with pytest.raises(ValueError, match="do not broadcast"):
        embed_layer_norm(args[0], torch.zeros(3, 3, dtype=torch.int64), *args[2:])
    with pytest.raises(ValueError, match="tables"):
        embed_layer_norm(*args[:3], torch.zeros(50, 17), *args[4:])
