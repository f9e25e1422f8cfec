"""The Triton kernel behind QKVRotaryCache (contract and maths: ort_triton/ops/qkv_rotary_cache.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.qkv_rotary_cache import BLOCK_C, heads
from ..ops.rotary import BLOCK_DS, NUM_WARPS, block_s
from .rotary import rope_args, rope_rows


@triton.jit
def qkv_rotary_cache_fwd(QKV, COS, SIN, PK, PV, Q, K, V, NQ, NKV, S, P, D, R, cos_b, cos_s, per_pair, interleaved,
                         n_new, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    # flat grid, two kinds of program (all offsets int64):
    # - pid < n_new: the new rows, one (s-block, head h of NQ + 2 NKV, batch b) tile, the s-block fastest.
    #   QKV [B, S, NQ + 2 NKV, D] row (b, s, h) -> h < NQ: Q [B, NQ, S, D] row (b, h, s), rotated;
    #   h < NQ + NKV: present_key [B, NKV, P + S, D] row (b, h - NQ, P + s), rotated; else present_value's, as is.
    # - the rest: BLOCK_C elements of one (b, kv head) slab of past_key, then of past_value ([P, D], contiguous),
    #   copied to the start of that slab of present.
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
        y, mask = rope_rows(x_rows, COS, SIN, b * cos_b + rows64 * cos_s, rows < S, D, R, per_pair, interleaved,
                            h < NQ + NKV, BLOCK_D)
        if h < NQ:
            y_rows = Q + ((b * NQ + h) * s64 + rows64) * d64
        elif h < NQ + NKV:
            y_rows = K + ((b * NKV + (h - NQ)) * t64 + P + rows64) * d64
        else:
            y_rows = V + ((b * NKV + (h - NQ - NKV)) * t64 + P + rows64) * d64
        tl.store(y_rows[:, None] + tl.arange(0, BLOCK_D)[None, :], y.to(Q.dtype.element_ty), mask=mask)
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


def qkv_rotary_cache(qkv, cos, sin, past_key, past_value, interleaved=0, rotary_dim=0, *, out=None):
    """Run the kernel on torch tensors (tests, the interpreter, GPU timing); shapes as the contract says.
    out: (Q, present_key, present_value) buffers a test poisons; the launch is the library's."""
    import torch

    if qkv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"qkv_rotary_cache: dtype {qkv.dtype} not supported (float32, float16, bfloat16)")
    if qkv.dim() != 3 or past_key.dim() != 4 or past_value.shape != past_key.shape:
        raise ValueError(f"qkv_rotary_cache: QKV must be [B, S, (Nq + 2 Nkv) D] and past_key, past_value one "
                         f"[B, Nkv, P, D] shape, got {list(qkv.shape)}, {list(past_key.shape)}, "
                         f"{list(past_value.shape)}")
    nq, nkv, d = heads(qkv.shape, past_key.shape)
    batch, seq, past = qkv.shape[0], qkv.shape[1], past_key.shape[2]
    if past_key.shape[0] != batch:
        raise ValueError(f"qkv_rotary_cache: past_key's batch {past_key.shape[0]} is not QKV's {batch}")
    cos, sin, r, w, cos_b, cos_s = rope_args("qkv_rotary_cache", cos, sin, qkv.dtype, batch, seq, d, rotary_dim)
    qkv, past_key, past_value = qkv.contiguous(), past_key.contiguous(), past_value.contiguous()
    q, k, v = out if out is not None else (qkv.new_empty(batch, nq, seq, d), qkv.new_empty(batch, nkv, past + seq, d),
                                           qkv.new_empty(batch, nkv, past + seq, d))
    bd = next(b for b in BLOCK_DS if d <= b)
    bs = block_s(bd)
    n_new = triton.cdiv(seq, bs) * (nq + 2 * nkv) * batch
    grid = n_new + 2 * batch * nkv * triton.cdiv(past * d, BLOCK_C)
    if grid:  # S = 0 still copies the past
        qkv_rotary_cache_fwd[(grid,)](
            qkv, cos, sin, past_key, past_value, q, k, v, nq, nkv, seq, past, d, r, cos_b, cos_s, int(w != r),
            int(bool(interleaved)), n_new, BLOCK_S=bs, BLOCK_D=bd, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
    return q, k, v
