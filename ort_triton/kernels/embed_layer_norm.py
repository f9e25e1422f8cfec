"""The Triton kernel behind EmbedLayerNorm (contract and maths: ort_triton/ops/embed_layer_norm.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.embed_layer_norm import MAX_HIDDEN, launch_config, layout


@triton.jit
def _lookup(ids, table, tb, ts, stride_b, stride_s, V, H, cols, col_ok, row_ok):
    """The table rows of the tokens (tb, ts) in fp32, and which of their ids lie outside [-V, V). A bad
    id's row is never read (zeros here); negative ids count from the end, as ONNX Gather's."""
    idx = tl.load(ids + tb * stride_b + ts * stride_s, mask=row_ok, other=0)  # int64
    bad = (idx < -V) | (idx >= V)
    idx = tl.where(idx < 0, idx + V, idx)
    ok = row_ok & ~bad
    # int64 ids: id * H can pass 2^31 in a large table
    x = tl.load(table + idx[:, None] * H + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
    return x.to(tl.float32), bad


@triton.jit
def embed_layer_norm_fwd(
    I0, I1, I2, T0, T1, T2, W, B, Y, n_rows, S, b0, s0, b1, s1, b2, s2, V0, V1, V2, H, eps,
    BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # token index b * S + s of Y [B, S, H]
    row_ok = rows < n_rows
    tb, ts = rows // S, rows % S
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    mask = row_ok[:, None] & col_ok[None, :]
    # All three rows are loaded before anything is summed, so the gathers' loads overlap.
    e0, bad0 = _lookup(I0, T0, tb, ts, b0, s0, V0, H, cols, col_ok, row_ok)
    e1, bad1 = _lookup(I1, T1, tb, ts, b1, s1, V1, H, cols, col_ok, row_ok)
    e2, bad2 = _lookup(I2, T2, tb, ts, b2, s2, V2, H, cols, col_ok, row_ok)
    x = (e0 + e1) + e2  # the order the exported graph adds them in
    # two-pass LayerNorm in fp32, as layer_norm_fwd (div_rn, sqrt_rn: see there)
    h = tl.full([], H, tl.float32)
    mean = tl.div_rn(tl.sum(x, axis=1), h)
    d = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.div_rn(tl.sum(d * d, axis=1), h) + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = d * rstd[:, None] * w[None, :] + b[None, :]
    y = tl.where((bad0 | bad1 | bad2)[:, None], float("nan"), y)  # an id outside its table: a NaN row
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _broadcast_strides(ids) -> tuple[int, int]:
    """(batch stride, sequence stride) of a contiguous [B', S'] id tensor read as [B, S]: 0 on a broadcast 1."""
    return (ids.shape[1] if ids.shape[0] != 1 else 0), (1 if ids.shape[1] != 1 else 0)


# ---- a torch entry point: the same kernel through Triton's JIT (tests, interpreter, GPU timing) -------
def embed_layer_norm(input_ids, token_type_ids, position_ids, word, token_type, position, gamma, beta,
                     epsilon=1e-12, *, out=None, config: tuple[int, int] | None = None):
    """Run the kernel on torch tensors; returns Y [B, S, H]. `out` lets a test hand in a poisoned buffer;
    `config` = (ROWS, num_warps) overrides launch_config."""
    import torch

    ids = [t.contiguous() for t in (input_ids, token_type_ids, position_ids)]
    tables = [t.contiguous() for t in (word, token_type, position)]
    h = gamma.shape[0]
    if not 1 <= h <= MAX_HIDDEN:
        raise ValueError(f"embed_layer_norm: hidden size {h} not supported (1..{MAX_HIDDEN})")
    if gamma.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"embed_layer_norm: dtype {gamma.dtype} not supported (float32, float16, bfloat16)")
    for t in ids:
        if t.dtype != torch.int64 or t.dim() != 2:
            raise ValueError(f"embed_layer_norm: ids must be int64 [B', S'], got {t.dtype} {list(t.shape)}")
    for name, t in (("tables", tables[0]), ("tables", tables[1]), ("tables", tables[2]), ("beta", beta)):
        if t.dtype != gamma.dtype or t.shape[-1] != h:
            raise ValueError(f"embed_layer_norm: {name} must be {gamma.dtype} [..., {h}], got {t.dtype} "
                             f"{list(t.shape)}")
    batch = seq = 1
    for t in ids:  # the broadcast of the three [B', S']
        for axis in (0, 1):
            n, have = t.shape[axis], (batch, seq)[axis]
            if n != 1 and have not in (1, n):
                raise ValueError(f"embed_layer_norm: id shapes {[list(i.shape) for i in ids]} do not broadcast")
            if n != 1:
                batch, seq = (n, seq) if axis == 0 else (batch, n)
    n_rows = batch * seq
    y = out if out is not None else torch.empty((batch, seq, h), dtype=gamma.dtype, device=gamma.device)
    if tuple(y.shape) != (batch, seq, h) or y.dtype != gamma.dtype:
        raise ValueError(f"embed_layer_norm: out must be {gamma.dtype} {[batch, seq, h]}")
    if n_rows == 0:
        return y
    lay = layout(h)
    rows, warps = config or launch_config(lay["BLOCK_H"])
    strides = [s for t in ids for s in _broadcast_strides(t)]
    embed_layer_norm_fwd[(triton.cdiv(n_rows, rows),)](
        *ids, *tables, gamma, beta, y, n_rows, seq, *strides, *(t.shape[0] for t in tables), h, epsilon,
        **lay, ROWS=rows, num_warps=warps,
    )
    return y
