"""The Triton kernel behind CausalAttention (contract: ort_triton/ops/causal_attention.py): flash attention,
forward only, causal with an offset, grouped-query, over a KV cache.

One program takes BLOCK_M packed rows of one (batch b, KV head g). Row r stands for query i = r // G of
query head h = g * G + r % G (G = Nq / Nkv), so the G heads that share a KV head read each K/V block
once; in a decode step (S = 1) the M dimension is exactly those G heads. In base-2 units (exp2 is the
hardware's exponential; log2(e) folded into the scale and the bias), per row

    s_j = (q . k_j) * scale * log2(e) + key_bias_j * log2(e)   for j <= T - S + i (visible), else -inf
    m = max_j s_j,   l = sum_j 2^(s_j - m),   y = sum_j 2^(s_j - m) v_j / l

online over key blocks of BLOCK_N (state rescaled by 2^(m_old - m_new)), as kernels/attention.py does,
whose `_attend` runs the key blocks every row of the tile sees whole. The tile's rows see keys up to
T - S + i_hi (i_hi its last query); blocks past that are never visited (skipped, not masked), and only
the blocks between T - S + i_lo + 1 (every row sees them) and that end carry the causal mask.

Rows with no visible key left (l = 0: every key they see has key_bias -inf): 0, or with MEAN_ROWS the mean
of V over all T keys (eager attention's meaning, see the contract), summed in one more pass over V that
only a tile holding such a row runs. Finite biases saturate at -1e38 as in kernels/attention.py, so a
row seeing only finfo.min keys is uniform over them, NaN-free. Rows past G * S and head-dim lanes past
HEAD_DIM load 0 and are never stored. Offsets are int64.

Split over the cache (SPLIT_K specs, the decode ones): a decode step has B * Nkv programs, 8 for Llama-1B at
batch 1, which leaves most of a GPU idle while each streams a whole cache. The same kernel then runs twice
(flash-decoding): PHASE 1 gives each program one chunk of SPLIT keys (a multiple of BLOCK_N) and stores
its unnormalised state (acc, m, l) in the fp32 workspace WS; PHASE 2 (one program per row tile) merges the
chunks' states, m = max_c m_c, l = sum_c 2^(m_c - m) l_c, acc = sum_c 2^(m_c - m) acc_c, and finishes as
PHASE 0 (one pass, no workspace) does. ops/causal_attention.py `split_keys` picks SPLIT. The merge takes
MERGE_BLOCK chunks at a time, their loads issued together (`_merge_blocked`; ops/causal_attention.py
`merge_block` sizes it); MERGE_BLOCK = 0 merges one chunk after another, each step waiting on its loads
(kept so that the GPU sweep can time both).
WS: acc [programs, chunks, BLOCK_M, BLOCK_D], then (m, l) [programs, chunks, BLOCK_M, 2].

PHASE 3 does both in one launch (FUSED_MERGE specs): each chunk's program stores its state as PHASE 1 does, then
takes a ticket from its row tile's counter CNT[pid] (a barrier first, so that every thread's stores come before
the program's release; the ticket's acquire then orders the merge's loads after every other chunk's stores);
the program that draws the last ticket merges the chunks as PHASE 2 does, writes Y, and sets the counter back
to 0. So the counters must start at 0, and each launch leaves them so: the native library keeps a zeroed buffer
per node and CUDA stream (native/ort_triton.c), the torch entry one per device. The merge's loads bypass L1 (".cg"):
another SM wrote those lines during this launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.causal_attention import (
    CAUSAL_HEAD_DIMS,
    MERGE_COUNTERS,
    SPLIT_MIN_KEYS,
    block_config,
    merge_of,
    split_chunks,
    split_keys,
    workspace_floats,
)
from ..ops.kv_layout import TO_HEADS
from .attention import _LOG2E, _attend, _log2_key_bias, _softmax_step


@triton.jit
def _attend_diagonal(q, k_ptrs, v_ptrs, kb_ptrs, start, T, last_key, offs_n, d_ok, m_i, l_i, acc, qk_scale,
                     V_TY: tl.constexpr, prec: tl.constexpr):
    """A key block that some rows of the tile see only in part: keys past T load masked (-inf bias), and
    key j counts for row r only if j <= last_key[r] (= T - S + i of the row)."""
    keys = start + offs_n
    key_ok = keys < T
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    kb = _log2_key_bias(tl.load(kb_ptrs, mask=key_ok, other=float("-inf")).to(tl.float32))
    s = tl.dot(q, tl.trans(k), input_precision=prec) * qk_scale + kb[None, :]
    s = tl.where(keys[None, :] <= last_key[:, None], s, float("-inf"))
    return _softmax_step(s, v, m_i, l_i, acc, V_TY, prec)


@triton.jit
def _merge_blocked(WS, ws_ml, ws_acc, first, n_merge, m_i, l_i, acc, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                   MERGE_BLOCK: tl.constexpr):
    """PHASE 2's merge, MERGE_BLOCK chunks at a time, unrolled: the block's m first, then each chunk's l and acc
    weighted by 2^(m_c - m). No load address hangs on an earlier result, so the unrolled loads issue together,
    where the loop over single chunks waits out one load latency per chunk (a decode merge is that latency, not
    bytes): on the H200 at head dim 64, fp16, 8 chunks a block, PHASE 2 took 4.1 us for 5 chunks and 5.7 for
    11, the loop 4.8 and 7.4. Each chunk stays a [BLOCK_M, BLOCK_D] tile in acc's own layout: one
    [MERGE_BLOCK, BLOCK_M, BLOCK_D] tile summed over its first axis made PHASE 2 1.1-2.1x slower than this
    (a reduction across warps, layout conversions), slower than the loop too. Chunks `first` ..
    `first + n_merge - 1` of the workspace; those past n_merge load as a chunk that saw no key (m = -inf, l = 0,
    acc = 0: weight 0)."""
    for c0 in range(0, n_merge, MERGE_BLOCK):
        m_new = m_i
        for j in tl.static_range(MERGE_BLOCK):
            m_c = tl.load(ws_ml + (first + c0 + j) * (BLOCK_M * 2), mask=c0 + j < n_merge, other=float("-inf"),
                          cache_modifier=".cg")
            m_new = tl.maximum(m_new, m_c)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no chunk saw a key yet: every weight 0, no NaN
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
        for j in tl.static_range(MERGE_BLOCK):
            part = first + c0 + j
            ok = c0 + j < n_merge
            m_c = tl.load(ws_ml + part * (BLOCK_M * 2), mask=ok, other=float("-inf"), cache_modifier=".cg")  # again
            l_c = tl.load(ws_ml + part * (BLOCK_M * 2) + 1, mask=ok, other=0.0, cache_modifier=".cg")
            acc_c = tl.load(WS + part * (BLOCK_M * BLOCK_D) + ws_acc, mask=ok, other=0.0, cache_modifier=".cg")
            w = tl.math.exp2(m_c - m_sub)  # 0 for a chunk without keys (m_c = -inf)
            l_i += l_c * w
            acc += acc_c * w[:, None]
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["T", "SPLIT", "PHASE"])  # as the AOT build: no variant per value
def causal_attention_fwd(
    Q, K, V, KB, Y, WS, NQ, NKV, S, T, scale, MEAN_ROWS, SPLIT, PHASE, CNT, B,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, MERGE_BLOCK: tl.constexpr, KV_SEQ_MAJOR: tl.constexpr = 0,
):
    # flat grid: cdiv(G * S, BLOCK_M) * B * NKV programs, the row block fastest (the programs of one KV
    # head run side by side and share its K/V in L2); PHASE 1 and 3: times the chunks, the chunk fastest
    pid = tl.program_id(0)
    if SPLIT_K:
        phase = tl.full([], 0, tl.int32) + PHASE
        split = tl.full([], 0, tl.int64) + SPLIT  # keys per chunk, >= 1 in every phase
        n_split = (tl.full([], 0, tl.int64) + T + split - 1) // split
        chunked = (phase == 1) | (phase == 3)  # a program per chunk, storing its state
        per = tl.where(chunked, n_split, 1)
        n_prog = tl.num_programs(0) // per
        chunk = pid % per
        pid = pid // per
    group = NQ // NKV
    rows = group * S
    num_m = tl.cdiv(rows, BLOCK_M)
    bg = pid // num_m
    m_blk = pid - bg * num_m
    b = (bg // NKV).to(tl.int64)
    g = (bg % NKV).to(tl.int64)
    # ints may arrive as plain Python 1s (Triton's JIT specialises them): widen through int64 tensors
    s_len = tl.full([], 0, tl.int64) + S
    t_len = tl.full([], 0, tl.int64) + T
    nq = tl.full([], 0, tl.int64) + NQ
    mean_rows = tl.full([], 0, tl.int32) + MEAN_ROWS
    prec: tl.constexpr = "tf32x3" if Q.dtype.element_ty == tl.float32 else "tf32"
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM

    offs_r = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_r < rows
    qi = offs_r // group  # the query (of S) of each row
    h = g * group + offs_r % group  # its query head
    q_offs = ((b * nq + h) * s_len + qi)[:, None] * HEAD_DIM + offs_d[None, :]
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_offs, mask=q_mask, other=0.0)

    # this (b, g)'s K and V as scalar pointers, and one block's offsets within them (int32: a head holds
    # T * D < 2^31 elements): the pointer tiles are rebuilt per block rather than carried through the loops,
    # which would keep [BLOCK_N, BLOCK_D] 64-bit pointers live in registers (ptxas spilled them). KV_SEQ_MAJOR (the
    # cache [T, B, NKV, D], ops/kv_layout.py): key j of (b, g) at j * B * NKV * D from the head's first (int32
    # still: the planner keeps T * B * NKV * D under 2^31), B the batch.
    if KV_SEQ_MAJOR:
        kv_head = (b * NKV + g) * HEAD_DIM
        kv_row = B * NKV * HEAD_DIM
    else:
        kv_head = (b * NKV + g) * t_len * HEAD_DIM
        kv_row = HEAD_DIM
    k_head, v_head = K + kv_head, V + kv_head
    kb_row = KB + b * t_len
    kv_tile = offs_n[:, None] * kv_row + offs_d[None, :]
    qk_scale = scale * _LOG2E

    # keys every row of the tile sees: j < T - S + i_lo + 1; the tile's last visible key: T - S + i_hi
    offset = T - S
    i_lo = (m_blk * BLOCK_M) // group
    i_hi = tl.minimum((m_blk * BLOCK_M + BLOCK_M - 1) // group, S - 1)
    last_key = offset + qi
    kv_end = offset + i_hi + 1
    full_end = ((offset + i_lo + 1) // BLOCK_N) * BLOCK_N

    # the keys this program visits: all it sees (PHASE 0), one chunk of them (1, 3), none (2: it merges)
    lo = 0
    hi = kv_end
    if SPLIT_K:
        lo = tl.where(chunked, chunk * split, 0)
        hi = tl.where(phase == 0, kv_end, tl.where(chunked, tl.minimum(lo + split, kv_end), 0))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, tl.minimum(full_end, hi), BLOCK_N):  # whole blocks, visible to every row: no mask
        blk = kv_tile + start * kv_row
        m_i, l_i, acc = _attend(q, k_head + blk, v_head + blk, kb_row + start + offs_n, start, T, offs_n, d_ok,
                                m_i, l_i, acc, qk_scale, V.dtype.element_ty, False, MASK_D, prec)
    for start in range(tl.maximum(full_end, lo), hi, BLOCK_N):  # the diagonal: causal mask and the key tail
        blk = kv_tile + start * kv_row
        m_i, l_i, acc = _attend_diagonal(q, k_head + blk, v_head + blk, kb_row + start + offs_n, start, T,
                                         last_key, offs_n, d_ok, m_i, l_i, acc, qk_scale, V.dtype.element_ty, prec)

    finish = True
    if SPLIT_K:
        # the chunk states of this row tile: [part, BLOCK_M, BLOCK_D] and [part, BLOCK_M, (m, l)]
        offs_m = tl.arange(0, BLOCK_M)
        ws_acc = (offs_m[:, None] * BLOCK_D + offs_d[None, :]).to(tl.int64)
        ws_ml = WS + n_prog * n_split * (BLOCK_M * BLOCK_D) + offs_m * 2
        part = pid * n_split + chunk
        store = chunked & (offs_m < BLOCK_M)  # every row: the phase test as a [BLOCK_M] mask
        tl.store(WS + part * (BLOCK_M * BLOCK_D) + ws_acc, acc, mask=store[:, None])
        tl.store(ws_ml + part * (BLOCK_M * 2), m_i, mask=store)
        tl.store(ws_ml + part * (BLOCK_M * 2) + 1, l_i, mask=store)
        # PHASE 3: every thread's stores, then the program's ticket; the last of the row tile's chunks merges
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + pid, 1, mask=phase == 3, sem="acq_rel", scope="gpu")
        last = (phase == 3) & (ticket == n_split - 1)
        m_i = tl.where(last, float("-inf"), m_i)  # it merges every chunk from WS, its own too: start empty
        l_i = tl.where(last, 0.0, l_i)
        acc = tl.where(last, 0.0, acc)
        n_merge = tl.where((phase == 2) | last, n_split, 0)  # PHASE 2 (and 3's last): merge the chunks
        if MERGE_BLOCK == 0:  # one chunk after another (each step waits on its loads)
            for c in range(0, n_merge):
                part = pid * n_split + c
                acc_c = tl.load(WS + part * (BLOCK_M * BLOCK_D) + ws_acc)
                m_c = tl.load(ws_ml + part * (BLOCK_M * 2))
                l_c = tl.load(ws_ml + part * (BLOCK_M * 2) + 1)
                m_new = tl.maximum(m_i, m_c)
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no chunk saw a key yet: weights 0
                alpha, beta = tl.math.exp2(m_i - m_sub), tl.math.exp2(m_c - m_sub)
                l_i = l_i * alpha + l_c * beta
                acc = acc * alpha[:, None] + acc_c * beta[:, None]
                m_i = m_new
        else:
            m_i, l_i, acc = _merge_blocked(WS, ws_ml, ws_acc, pid * n_split, n_merge, m_i, l_i, acc,
                                           BLOCK_M, BLOCK_D, MERGE_BLOCK)
        finish = (phase == 0) | (phase == 2) | last
        tl.store(CNT + pid, 0, mask=last)  # back to 0 for the next launch: every chunk has drawn its ticket

    fill = tl.zeros([BLOCK_D], tl.float32)
    empty = tl.sum(((l_i == 0.0) & row_ok).to(tl.int32), 0)
    if (mean_rows != 0) & (empty > 0) & finish:  # a row that sees no key: the mean of V over all T keys
        for j in range(0, T, BLOCK_N):
            kv_mask = (j + offs_n < T)[:, None] & d_ok[None, :]
            fill += tl.sum(tl.load(v_head + kv_tile + j * kv_row, mask=kv_mask, other=0.0).to(tl.float32), 0)
        fill = fill / T
    y = tl.where((l_i > 0.0)[:, None], acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], fill[None, :])
    y_offs = ((b * s_len + qi) * nq + h)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(Y + y_offs, y.to(Y.dtype.element_ty), mask=q_mask & finish)


# ---- a torch entry point: the same kernel through Triton's JIT (tests, interpreter, GPU timing) -------
def causal_attention(q, k, v, key_bias, scale, masked_rows=0, *, out=None, config: dict | None = None,
                     seq_major=0):
    """Y [B, S, Nq*D] for q [B, Nq, S, D], k and v [B, Nkv, T, D] (seq_major: [T, B, Nkv, D]; T >= S, Nq % Nkv == 0),
    key_bias [B, T] (all one dtype). `out` lets a test hand in a poisoned buffer; `config` overrides block_config's
    BLOCK_M, BLOCK_N, num_warps, num_stages and SPLIT_TARGET (tests use small blocks so several blocks run,
    and SPLIT_MIN_KEYS small so that short caches split into several chunks), MERGE_BLOCK (merge_block's
    by default; 0: the chunk-by-chunk merge), FUSED_MERGE (0: the merge in a second launch) and maxnreg (ptxas'
    register cap, as a spec's). The launches are the library's (native/causal_attention.c): one pass, the chunks
    with their merge in one launch, or the chunks then their merge."""
    import torch

    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"causal_attention: dtype {q.dtype} not supported (float32, float16, bfloat16)")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"causal_attention: q and k must be [B, N, S, D], got {list(q.shape)}, {list(k.shape)}")
    b, nq, s, d = q.shape
    heads_first = k.permute(TO_HEADS) if seq_major else k
    nkv, t = heads_first.shape[1], heads_first.shape[2]
    if d not in CAUSAL_HEAD_DIMS:
        raise ValueError(f"causal_attention: head dim {d} not supported "
                         f"(head dims {', '.join(map(str, CAUSAL_HEAD_DIMS))})")
    if heads_first.shape[0] != b or k.shape[3] != d or nkv < 1 or nq % nkv:
        layout = f"[T, B={b}, Nkv, D={d}]" if seq_major else f"[B={b}, Nkv, T, D={d}]"
        raise ValueError(f"causal_attention: k {list(k.shape)} must be {layout} with Nkv dividing Nq={nq}")
    if t < s:
        raise ValueError(f"causal_attention: the cache holds T={t} keys, fewer than the S={s} queries")
    for name, x, shape in (("v", v, tuple(k.shape)), ("key_bias", key_bias, (b, t)), ("out", out, (b, s, nq * d))):
        if x is not None and (tuple(x.shape) != shape or x.dtype != q.dtype or x.device != q.device):
            raise ValueError(f"causal_attention: {name} must be {q.dtype} of shape {list(shape)} on {q.device}, "
                             f"got {x.dtype} {list(x.shape)} on {x.device}")
    if out is not None and not out.is_contiguous():
        raise ValueError("causal_attention: out must be contiguous")
    rows = (nq // nkv) * s
    cfg = block_config(d, {torch.float32: "float", torch.float16: "float16", torch.bfloat16: "bfloat16"}[q.dtype],
                       rows, b * nkv)
    cfg.update(config or {})
    q, k, v, key_bias = q.contiguous(), k.contiguous(), v.contiguous(), key_bias.contiguous()
    y = out if out is not None else torch.empty((b, s, nq * d), dtype=q.dtype, device=q.device)
    programs = triton.cdiv(rows, cfg["BLOCK_M"]) * b * nkv
    if not programs:
        return y
    chunk = split_keys(t, programs, cfg["BLOCK_N"], cfg["SPLIT_TARGET"], cfg.get("SPLIT_MIN_KEYS", SPLIT_MIN_KEYS))

    def launch(ws, split, phase, grid, counters=None):
        causal_attention_fwd[(grid,)](
            q, k, v, key_bias, y, ws, nq, nkv, s, t, float(scale), int(masked_rows), split, phase,
            merge_counters(q.device, 0) if counters is None else counters,  # CNT: touched only in PHASE 3
            b, KV_SEQ_MAJOR=int(bool(seq_major)), HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            SPLIT_K=cfg["SPLIT_TARGET"] > 0, MERGE_BLOCK=merge_of(cfg, d), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"], **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))

    if not chunk:  # one pass (the workspace pointer unused, as the library's NULL)
        launch(torch.empty(1, dtype=torch.float32, device=q.device), cfg["BLOCK_N"], 0, programs)
        return y
    n_split = split_chunks(t, chunk)
    ws = torch.empty(workspace_floats(programs, n_split, cfg["BLOCK_M"], cfg["BLOCK_D"]), dtype=torch.float32,
                     device=q.device)
    if cfg.get("FUSED_MERGE") and programs <= MERGE_COUNTERS:  # one launch: the last chunk of each row tile
        # merges (PHASE 3); past the counters, two launches, as the library's planner does
        launch(ws, chunk, 3, programs * n_split, merge_counters(q.device, programs))
        return y
    launch(ws, chunk, 1, programs * n_split)  # each chunk's state
    launch(ws, chunk, 2, programs)  # merged, and Y
    return y


_COUNTERS: dict = {}


def merge_counters(device, programs: int):
    """PHASE 3's ticket counters on `device`: one zeroed int32 buffer of MERGE_COUNTERS, kept for the process (each
    launch leaves it zeroed, and launches on one stream run one after another, as the tuner's and tests' do)."""
    import torch

    if programs > MERGE_COUNTERS:
        raise ValueError(f"causal_attention: {programs} row tiles need more merge counters than {MERGE_COUNTERS}")
    key = str(device)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[key]
