"""The Triton kernels behind QKVRotaryCache, QKVNormRotaryCache and QKVCache, one body (contracts and maths:
ort_triton/ops/qkv_rotary_cache.py, ort_triton/ops/qkv_cache.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.kv_layout import TO_HEADS
from ..ops.qkv_rotary_cache import BLOCK_C, COPY_PROGRAMS, heads
from ..ops.rotary import BLOCK_DS, NUM_WARPS, block_s, half_split
from .rotary import rope_args, rope_store


@triton.jit
def qkv_heads_cache(QKV, BIAS, COS, SIN, PK, PV, QG, KG, Q, K, V, NQ, NKV, S, P, D, R, cos_b, cos_s, per_pair,
                    interleaved, n_new, eps, B, seq_major, copy, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_C: tl.constexpr, ROTARY: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                    HALF_SPLIT: tl.constexpr):
    # The body of QKVRotaryCache's kernel (ROTARY: q and k rotated with COS, SIN as Rotary's; BIAS unread) and
    # of QKVCache's (HAS_BIAS: BIAS [(NQ + 2 NKV) D] added, in fp32, to every row before the one rounding to
    # the output type; COS, SIN and the rotary scalars unread). Both at once is not an op (the bias would have
    # to go in before the rotation, into rope_rows' partner load too). NORM (QKVNormRotaryCache, with ROTARY): q heads
    # RMSNorm-ed with QG [D], k heads with KG, before the rotation (rope_rows); QG, KG and eps unread otherwise.
    # HALF_SPLIT (with ROTARY, the spec keyed half_split): rope_halves, whose loads an aligned spec vectorises.
    # Flat grid, two kinds of program (all offsets int64):
    # - pid < n_new: the new rows, one (s-block, head h of NQ + 2 NKV, batch b) tile, the s-block fastest.
    #   QKV [B, S, NQ + 2 NKV, D] row (b, s, h) -> h < NQ: Q [B, NQ, S, D] row (b, h, s), rotated;
    #   h < NQ + NKV: present_key [B, NKV, P + S, D] row (b, h - NQ, P + s), rotated; else present_value's, as is.
    # - the rest: BLOCK_C elements of one (b, kv head) slab of past_key, then of past_value ([P, D], contiguous),
    #   copied to the start of that slab of present.
    # seq_major (ops/kv_layout.py): past [P, B, NKV, D], present [P + S, B, NKV, D]; the new rows go to present row
    # ((P + s) B + b) NKV + g, and the past is one block of P B NKV D elements at the start of present, which the
    # rest of the programs (half for past_key, half for past_value) copy in BLOCK_C pieces, each piece n_copy
    # pieces after its last. copy (bit 0: the key, bit 1: the value) is 0 where present is past's own memory (the
    # caller bound both to one buffer): nothing to copy. B: the batch.
    tl.static_assert(not (ROTARY and HAS_BIAS), "a bias with rotary is not an op")
    tl.static_assert(ROTARY or not NORM, "the norm comes with the rotary")
    pid = tl.program_id(0)
    d64 = tl.full([], 0, tl.int64) + D
    s64 = tl.full([], 0, tl.int64) + S
    t64 = s64 + P  # present's sequence length
    if pid < n_new:
        n_s = tl.cdiv(S, BLOCK_S)
        heads = NQ + 2 * NKV
        s_blk = pid % n_s
        h = (pid // n_s) % heads
        b = (pid // n_s // heads).to(tl.int64)
        rows = s_blk * BLOCK_S + tl.arange(0, BLOCK_S)
        rows64 = rows.to(tl.int64)
        x_rows = QKV + ((b * S + rows64) * heads + h) * d64
        # selects, not branches: the alignment analysis keeps a select's divisibility and loses an scf.if's (the
        # stores were 2-byte scalars in every spec while these were branches)
        g = h - NQ - tl.where(h < NQ + NKV, 0, NKV)  # the kv head of a k or v row
        kv_row = tl.where(seq_major != 0, ((P + rows64) * B + b) * NKV + g, (b * NKV + g) * t64 + P + rows64) * d64
        y_rows = tl.where(h < NQ, Q + ((b * NQ + h) * s64 + rows64) * d64, tl.where(h < NQ + NKV, K, V) + kv_row)
        if ROTARY:
            gamma = QG  # unread without NORM: the default kernel compiles as before
            if NORM:
                gamma = QG if h < NQ else KG
            rope_store(x_rows, y_rows, COS, SIN, b * cos_b + rows64 * cos_s, rows < S, D, R, per_pair, interleaved,
                       h < NQ + NKV, gamma, eps, h < NQ + NKV, BLOCK_D, NORM, HALF_SPLIT)
        else:
            cols = tl.arange(0, BLOCK_D)
            mask = (rows < S)[:, None] & (cols < D)[None, :]
            y = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
            if HAS_BIAS:  # the head's D channels of the bias, one load for the tile's rows
                bias = tl.load(BIAS + h * d64 + cols, mask=cols < D, other=0.0)
                y = y.to(tl.float32) + bias.to(tl.float32)[None, :]
            tl.store(y_rows[:, None] + cols[None, :], y.to(Q.dtype.element_ty), mask=mask)
    elif seq_major != 0:  # only launched when P > 0
        c = pid - n_new
        n_copy = (tl.num_programs(0) - n_new) // 2
        total = (tl.full([], 0, tl.int64) + P) * B * NKV * d64
        first = (c % n_copy).to(tl.int64) * BLOCK_C
        if c < n_copy:
            src, dst, on = PK, K, copy & 1
        else:
            src, dst, on = PV, V, copy & 2
        if on != 0:
            for start in range(first, total, n_copy.to(tl.int64) * BLOCK_C):
                offs = start + tl.arange(0, BLOCK_C)
                ok = offs < total
                tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)
    else:  # only launched when P > 0
        slab_len = (tl.full([], 0, tl.int64) + P) * d64
        per_slab = tl.cdiv(slab_len, BLOCK_C)
        c = pid - n_new
        kv_slabs = (tl.num_programs(0) - n_new) // (2 * per_slab)  # B * NKV
        slab = c // per_slab
        offs = (c % per_slab) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = offs < slab_len
        if slab < kv_slabs:
            src = PK + slab * slab_len
            dst = K + slab * t64 * d64
        else:
            src = PV + (slab - kv_slabs) * slab_len
            dst = V + (slab - kv_slabs) * t64 * d64
        tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


@triton.jit
def qkv_rotary_cache_fwd(QKV, COS, SIN, PK, PV, Q, K, V, NQ, NKV, S, P, D, R, cos_b, cos_s, per_pair, interleaved,
                         n_new, B, seq_major, copy, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                         HALF_SPLIT: tl.constexpr):
    """QKVRotaryCache: the shared body, rotary on, no bias, no norm (BIAS, QG, KG: QKV, never read)."""
    qkv_heads_cache(QKV, QKV, COS, SIN, PK, PV, QKV, QKV, Q, K, V, NQ, NKV, S, P, D, R, cos_b, cos_s, per_pair,
                    interleaved, n_new, 0.0, B, seq_major, copy, BLOCK_S, BLOCK_D, BLOCK_C, True, False, False,
                    HALF_SPLIT)


@triton.jit
def qkv_norm_rotary_cache_fwd(QKV, COS, SIN, PK, PV, QG, KG, Q, K, V, NQ, NKV, S, P, D, R, cos_b, cos_s, per_pair,
                              interleaved, n_new, eps, B, seq_major, copy, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_C: tl.constexpr, HALF_SPLIT: tl.constexpr):
    """QKVNormRotaryCache: the shared body, q and k RMSNorm-ed then rotated, no bias (BIAS: QKV, never read)."""
    qkv_heads_cache(QKV, QKV, COS, SIN, PK, PV, QG, KG, Q, K, V, NQ, NKV, S, P, D, R, cos_b, cos_s, per_pair,
                    interleaved, n_new, eps, B, seq_major, copy, BLOCK_S, BLOCK_D, BLOCK_C, True, False, True,
                    HALF_SPLIT)


@triton.jit
def qkv_cache_fwd(QKV, BIAS, PK, PV, Q, K, V, NQ, NKV, S, P, D, n_new, B, seq_major, copy,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """QKVCache (ort_triton/ops/qkv_cache.py): the shared body with the bias, no rotary (COS, SIN: BIAS and the
    rotary scalars 0, never read)."""
    qkv_heads_cache(QKV, BIAS, BIAS, BIAS, PK, PV, BIAS, BIAS, Q, K, V, NQ, NKV, S, P, D, 0, 0, 0, 0, 0,
                    n_new, 0.0, B, seq_major, copy, BLOCK_S, BLOCK_D, BLOCK_C, False, True, False, False)


def _check(name, qkv, past_key, past_value, seq_major=0):
    """(Nq, Nkv, D, B, S, P) of a launch's QKV and past (seq_major: [P, B, Nkv, D]), checked as the native planner
    checks them."""
    import torch

    if qkv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: dtype {qkv.dtype} not supported (float32, float16, bfloat16)")
    layout = "[P, B, Nkv, D]" if seq_major else "[B, Nkv, P, D]"
    if qkv.dim() != 3 or past_key.dim() != 4 or past_value.shape != past_key.shape:
        raise ValueError(f"{name}: QKV must be [B, S, (Nq + 2 Nkv) D] and past_key, past_value one "
                         f"{layout} shape, got {list(qkv.shape)}, {list(past_key.shape)}, {list(past_value.shape)}")
    heads_first = past_key.permute(TO_HEADS).shape if seq_major else past_key.shape
    nq, nkv, d = heads(qkv.shape, heads_first)
    batch, seq, past = qkv.shape[0], qkv.shape[1], heads_first[2]
    if heads_first[0] != batch:
        raise ValueError(f"{name}: past_key's batch {heads_first[0]} is not QKV's {batch}")
    return nq, nkv, d, batch, seq, past


def _grid(nq, nkv, d, batch, seq, past, half=0, seq_major=0):
    """(BLOCK_S, BLOCK_D, n_new, programs) as the planner computes them (the specs' blocks by D; half: the
    half-split spec's)."""
    bd = next(b for b in BLOCK_DS if d <= b)
    bs = block_s(bd, half)
    n_new = triton.cdiv(seq, bs) * (nq + 2 * nkv) * batch
    if seq_major:
        return bs, bd, n_new, n_new + 2 * min(triton.cdiv(past * batch * nkv * d, BLOCK_C), COPY_PROGRAMS)
    return bs, bd, n_new, n_new + 2 * batch * nkv * triton.cdiv(past * d, BLOCK_C)


def _outputs(qkv, out, nq, nkv, d, batch, seq, past, seq_major=0):
    cache = (past + seq, batch, nkv, d) if seq_major else (batch, nkv, past + seq, d)
    return out if out is not None else (qkv.new_empty(batch, nq, seq, d), qkv.new_empty(cache), qkv.new_empty(cache))


def _copy_bits(past_key, past_value, k, v, seq_major):
    """The kernel's copy argument: bit 0 the key's past, bit 1 the value's, each unless present is past's memory
    (sequence first only: heads first, present's slabs are laid out otherwise and always copied)."""
    if not seq_major:
        return 3
    return int(k.data_ptr() != past_key.data_ptr()) | 2 * int(v.data_ptr() != past_value.data_ptr())


def qkv_rotary_cache(qkv, cos, sin, past_key, past_value, interleaved=0, rotary_dim=0, *, out=None, q_gamma=None,
                     k_gamma=None, epsilon=1e-6, seq_major=0):
    """Run the kernel on torch tensors (tests, the interpreter, GPU timing); shapes as the contract says.
    out: (Q, present_key, present_value) buffers a test poisons; the launch is the library's. q_gamma and k_gamma
    ([D] each, both or neither): QKVNormRotaryCache's kernel, q and k RMSNorm-ed with them first. seq_major: the
    cache sequence first (ops/kv_layout.py); a present in out that starts where its past does is taken to hold it."""
    nq, nkv, d, batch, seq, past = _check("qkv_rotary_cache", qkv, past_key, past_value, seq_major)
    cos, sin, r, w, cos_b, cos_s = rope_args("qkv_rotary_cache", cos, sin, qkv.dtype, batch, seq, d, rotary_dim)
    qkv, past_key, past_value = qkv.contiguous(), past_key.contiguous(), past_value.contiguous()
    q, k, v = _outputs(qkv, out, nq, nkv, d, batch, seq, past, seq_major)
    half = half_split(d, r, w, interleaved)
    bs, bd, n_new, grid = _grid(nq, nkv, d, batch, seq, past, half, seq_major)
    scalars = (nq, nkv, seq, past, d, r, cos_b, cos_s, int(w != r), int(bool(interleaved)), n_new)
    layout = (batch, int(bool(seq_major)), _copy_bits(past_key, past_value, k, v, seq_major))
    blocks = dict(BLOCK_S=bs, BLOCK_D=bd, BLOCK_C=BLOCK_C, HALF_SPLIT=half, num_warps=NUM_WARPS)
    if (q_gamma is None) != (k_gamma is None):
        raise ValueError("qkv_rotary_cache: give both q_gamma and k_gamma, or neither")
    if q_gamma is not None:
        for g in (q_gamma, k_gamma):
            if g.shape != (d,) or g.dtype != qkv.dtype:
                raise ValueError(f"qkv_rotary_cache: gammas must be [{d}] of QKV's type, got {list(g.shape)} {g.dtype}")
        if grid:
            qkv_norm_rotary_cache_fwd[(grid,)](qkv, cos, sin, past_key, past_value, q_gamma.contiguous(),
                                               k_gamma.contiguous(), q, k, v, *scalars, epsilon, *layout, **blocks)
    elif grid:  # S = 0 still copies the past
        qkv_rotary_cache_fwd[(grid,)](qkv, cos, sin, past_key, past_value, q, k, v, *scalars, *layout, **blocks)
    return q, k, v


def qkv_cache(qkv, bias, past_key, past_value, *, out=None, seq_major=0):
    """QKVCache's kernel on torch tensors (tests, the interpreter, GPU timing); shapes as its contract says
    (ort_triton/ops/qkv_cache.py). out: (Q, present_key, present_value) buffers a test poisons; seq_major as
    qkv_rotary_cache's."""
    nq, nkv, d, batch, seq, past = _check("qkv_cache", qkv, past_key, past_value, seq_major)
    if bias.shape != (qkv.shape[-1],) or bias.dtype != qkv.dtype:
        raise ValueError(f"qkv_cache: bias must be [{qkv.shape[-1]}] of QKV's type, got {list(bias.shape)} "
                         f"{bias.dtype}")
    qkv, bias = qkv.contiguous(), bias.contiguous()
    past_key, past_value = past_key.contiguous(), past_value.contiguous()
    q, k, v = _outputs(qkv, out, nq, nkv, d, batch, seq, past, seq_major)
    bs, bd, n_new, grid = _grid(nq, nkv, d, batch, seq, past, seq_major=seq_major)
    if grid:  # S = 0 still copies the past
        qkv_cache_fwd[(grid,)](qkv, bias, past_key, past_value, q, k, v, nq, nkv, seq, past, d, n_new, batch,
                               int(bool(seq_major)), _copy_bits(past_key, past_value, k, v, seq_major),
                               BLOCK_S=bs, BLOCK_D=bd, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
    return q, k, v
