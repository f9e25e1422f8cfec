"""The Triton kernel behind Rotary (contract and maths: ort_triton/ops/rotary.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.rotary import BLOCK_DS, MAX_HEAD_DIM, NUM_WARPS, block_s, half_split


@triton.jit
def rope_rows(x_rows, COS, SIN, c_rows, row_ok, D, R, per_pair, interleaved, rotate, G, eps, normalize,
              BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    """One tile of rows: x_rows [BLOCK_S] pointers to each row's channel 0, c_rows [BLOCK_S] the offset of its
    cos/sin row; rotate (scalar) 0 passes the rows through. Returns (y fp32 [BLOCK_S, BLOCK_D], its store mask).
    Channel j < R:
      y[j] = x[j] * C[j] + sign(j) * x[p(j)] * S[j]
      half-split:  p(j) = (j + R/2) mod R, sign -1 for j < R/2;  interleaved: p(j) = j xor 1, sign -1 at even j
      C[j] = cos[j] (W = R) or one value per pair, cos[j mod R/2] / cos[j // 2] (W = R/2)
    channels j >= R: y[j] = x[j]. The partner load hits the lines the first load brought in.
    NORM (QKVNormRotaryCache), where normalize (scalar) is set: x is first each row's RMSNorm over its D channels
    with gamma G [D], as the RMSNorm op computes it, T(x * (1 / sqrt(mean(x^2) + eps)) * gamma), rounded to the
    element type T before the rotation reads it (the unfused chain's RMSNorm output); x[p(j)] the same, with
    gamma[p(j)]. Masked channels load 0 and add nothing to the mean."""
    cols = tl.arange(0, BLOCK_D)
    half = R // 2
    odd = cols % 2
    first = cols < half
    partner = tl.where(interleaved != 0, cols + 1 - 2 * odd, tl.where(first, cols + half, cols - half))
    negate = tl.where(interleaved != 0, odd == 0, first)
    cidx = tl.where(per_pair != 0, tl.where(interleaved != 0, cols // 2, tl.where(first, cols, cols - half)), cols)
    mask = row_ok[:, None] & (cols < D)[None, :]
    rot = row_ok[:, None] & (cols < R)[None, :] & (rotate != 0)
    x = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_rows[:, None] + partner[None, :], mask=rot, other=0.0).to(tl.float32)
    if NORM:
        T = x_rows.dtype.element_ty
        ms = tl.div_rn(tl.sum(x * x, axis=1), tl.full([], 0, tl.float32) + D)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))[:, None]
        g = tl.load(G + cols, mask=cols < D, other=0.0).to(tl.float32)
        gp = tl.load(G + partner, mask=cols < R, other=0.0).to(tl.float32)
        x = tl.where(normalize != 0, (x * rstd * g[None, :]).to(T).to(tl.float32), x)
        xp = tl.where(normalize != 0, (xp * rstd * gp[None, :]).to(T).to(tl.float32), xp)
    c_offs = c_rows[:, None] + cidx[None, :]
    c = tl.load(COS + c_offs, mask=rot, other=1.0).to(tl.float32)  # pass-through: x * 1 + x_p * 0
    s = tl.load(SIN + c_offs, mask=rot, other=0.0).to(tl.float32)
    return x * c + tl.where(negate[None, :], -xp, xp) * s, mask


@triton.jit
def rope_halves(x_rows, COS, SIN, c_rows, row_ok, per_pair, rotate, G, eps, normalize,
                BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    """rope_rows where the pairs are half-split and R = D = BLOCK_D (the specs keyed half_split): each row read as
    two [BLOCK_S, BLOCK_D/2] halves at constant channel offsets, masked by row alone, so an aligned spec moves
    128-bit vectors (rope_rows' partner and cos/sin indices, built with tl.where on runtime flags, leave ptxas
    scalar loads: scripts/sass_memory_audit.py). Returns (y1, y2, the rows' mask [BLOCK_S, 1]), y = [y1 | y2]:
      y1 = x1 * C1 - x2 * S1,   y2 = x2 * C2 + x1 * S2
      C1 = cos[:R/2];  C2 = cos[R/2:] (W = R) or cos[:R/2] again (W = R/2: one value per pair)
    rotate, NORM and normalize as rope_rows'."""
    HALF: tl.constexpr = BLOCK_D // 2
    cols = tl.arange(0, HALF)[None, :]
    ok = row_ok[:, None]
    x1 = tl.load(x_rows[:, None] + cols, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows[:, None] + HALF + cols, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        T = x_rows.dtype.element_ty
        ms = tl.div_rn(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), tl.full([], BLOCK_D, tl.float32))
        rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))[:, None]
        g1 = tl.load(G + cols).to(tl.float32)
        g2 = tl.load(G + HALF + cols).to(tl.float32)
        x1 = tl.where(normalize != 0, (x1 * rstd * g1).to(T).to(tl.float32), x1)
        x2 = tl.where(normalize != 0, (x2 * rstd * g2).to(T).to(tl.float32), x2)
    rot = ok & (rotate != 0)
    c1 = c_rows[:, None] + cols
    c2 = c1 + (1 - per_pair) * HALF  # a multiple of HALF: the vectors stay aligned
    cos1 = tl.load(COS + c1, mask=rot, other=1.0).to(tl.float32)  # pass-through: x * 1 + x_p * 0
    sin1 = tl.load(SIN + c1, mask=rot, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + c2, mask=rot, other=1.0).to(tl.float32)
    sin2 = tl.load(SIN + c2, mask=rot, other=0.0).to(tl.float32)
    return x1 * cos1 + (-x2) * sin1, x2 * cos2 + x1 * sin2, ok


@triton.jit
def rope_store(x_rows, y_rows, COS, SIN, c_rows, row_ok, D, R, per_pair, interleaved, rotate, G, eps, normalize,
               BLOCK_D: tl.constexpr, NORM: tl.constexpr, HALF_SPLIT: tl.constexpr):
    """The rows rotated (rope_halves where HALF_SPLIT, the spec keyed half_split: not interleaved, R = D = BLOCK_D;
    rope_rows otherwise) and stored at y_rows [BLOCK_S] (each row's channel 0) in y_rows' element type."""
    T = y_rows.dtype.element_ty
    if HALF_SPLIT:
        y1, y2, ok = rope_halves(x_rows, COS, SIN, c_rows, row_ok, per_pair, rotate, G, eps, normalize, BLOCK_D, NORM)
        cols = tl.arange(0, BLOCK_D // 2)[None, :]
        tl.store(y_rows[:, None] + cols, y1.to(T), mask=ok)
        tl.store(y_rows[:, None] + BLOCK_D // 2 + cols, y2.to(T), mask=ok)
    else:
        y, mask = rope_rows(x_rows, COS, SIN, c_rows, row_ok, D, R, per_pair, interleaved, rotate, G, eps, normalize,
                            BLOCK_D, NORM)
        tl.store(y_rows[:, None] + tl.arange(0, BLOCK_D)[None, :], y.to(T), mask=mask)


@triton.jit
def rotary_fwd(X, COS, SIN, Y, N, S, D, R, cos_b, cos_s, per_pair, interleaved,
               BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, X_BSND: tl.constexpr, HALF_SPLIT: tl.constexpr):
    # program (s-block, head n, batch b) of Y [B, N, S, D] (contiguous), reading X [B, N, S, D] or, X_BSND
    # (TransposeRotary), X [B, S, N, D], the head transpose done on the way; cos/sin row (b', s') at
    # b * cos_b + s * cos_s (a stride 0 broadcasts); the maths in rope_rows.
    pid_s = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    n = tl.program_id(1)
    if X_BSND:  # int64: B*N*S*D > 2^31
        x_rows = X + ((b * S + rows.to(tl.int64)) * N + n) * D
    else:
        x_rows = X + ((b * N + n) * S + rows.to(tl.int64)) * D
    rope_store(x_rows, Y + ((b * N + n) * S + rows.to(tl.int64)) * D, COS, SIN, b * cos_b + rows.to(tl.int64) * cos_s,
               rows < S, D, R, per_pair, interleaved, 1, X, 0.0, 0, BLOCK_D, False, HALF_SPLIT)


def rope_args(name, cos, sin, dtype, batch, seq, d, rotary_dim):
    """The rotary arguments of a launch, checked as the native planner's ot_rotary_cos checks them: R (rotary_dim,
    0: D), cos and sin [B', S', W] contiguous (the 1 after B' of the rank-4 form dropped), W and the cos row
    strides (0 broadcasts). Returns (cos, sin, R, W, cos_b, cos_s); name heads the messages."""
    r = rotary_dim or d
    if d > MAX_HEAD_DIM or r % 2 or not 2 <= r <= d:
        raise ValueError(f"{name}: D={d}, rotary_dim={r}: need an even rotary_dim in 2..D and D <= {MAX_HEAD_DIM}")
    if cos.shape != sin.shape or cos.dtype != dtype or sin.dtype != dtype:
        raise ValueError(f"{name}: cos and sin must be one shape and X's type, got {list(cos.shape)}, "
                         f"{list(sin.shape)}")
    if cos.dim() == 4 and cos.shape[1] == 1:
        cos, sin = cos[:, 0], sin[:, 0]
    if (cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] not in (1, seq)
            or cos.shape[2] not in (r, r // 2)):
        raise ValueError(f"{name}: cos must be [1 or B, 1 or S, R or R/2] (or with a 1 after B), got {list(cos.shape)}")
    w = cos.shape[2]
    cos_s = w if cos.shape[1] > 1 else 0
    cos_b = cos.shape[1] * w if cos.shape[0] > 1 else 0
    return cos.contiguous(), sin.contiguous(), r, w, cos_b, cos_s


def rotary(x, cos, sin, interleaved=0, rotary_dim=0, *, out=None, x_bsnd=False):
    """Run the kernel on torch tensors (tests, the interpreter, GPU timing); shapes as the contract says.
    x_bsnd: X is [B, S, N, D] (TransposeRotary); Y is [B, N, S, D] either way."""
    import torch

    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"rotary: dtype {x.dtype} not supported (float32, float16, bfloat16)")
    if x.dim() != 4:
        raise ValueError(f"rotary: X must be [B, {'S, N' if x_bsnd else 'N, S'}, D], got {list(x.shape)}")
    batch, heads, seq, d = (x.shape[0], x.shape[2], x.shape[1], x.shape[3]) if x_bsnd else x.shape
    cos, sin, r, w, cos_b, cos_s = rope_args("rotary", cos, sin, x.dtype, batch, seq, d, rotary_dim)
    x = x.contiguous()
    y = out if out is not None else x.new_empty(batch, heads, seq, d)
    bd = next(b for b in BLOCK_DS if d <= b)
    half = half_split(d, r, w, interleaved)
    bs = block_s(bd, half)
    if x.numel():
        rotary_fwd[(triton.cdiv(seq, bs), heads, batch)](
            x, cos, sin, y, heads, seq, d, r, cos_b, cos_s, int(w != r), int(bool(interleaved)),
            BLOCK_S=bs, BLOCK_D=bd, X_BSND=bool(x_bsnd), HALF_SPLIT=half, num_warps=NUM_WARPS)
    return y
