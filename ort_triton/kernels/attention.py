"""The Triton kernel behind MultiHeadAttention (contract: ort_triton/ops/attention.py): flash attention,
forward only, reading Q/K/V in the projections' own [B, S, N*D] layout.

One program computes BLOCK_M query rows of one (batch b, head n) and streams that head's keys and values
in blocks of BLOCK_N, never materialising the [Sq, Skv] score matrix. With scores in base-2 units
(exp2 is the hardware's exponential, so log2(e) is folded into the scale and the bias),

    kb_j = key_bias_j * log2(e)                       (finite biases first saturated at -1e38, see below)
    s_j  = (q . k_j) * scale * log2(e) + kb_j
    m    = max_j s_j,   l = sum_j 2^(s_j - m),   y = sum_j 2^(s_j - m) v_j / l

computed online: for each new block of keys the running state is rescaled by alpha = 2^(m_old - m_new),
l = l * alpha + sum(p), acc = acc * alpha + p @ V. Everything after the two dots is fp32; the P @ V dot
takes p in the element type (tensor cores), accumulating in fp32. fp32 inputs use 3xTF32 dots, which
keep fp32 accuracy on tensor cores (plain TF32 would lose 3 digits).

The K and V projections' biases: k_bias is never read, since it adds q . k_bias to every score of a row
and softmax cancels that; v_bias is added to each output row that saw a key (the weights sum to 1).

Packed Q/K/V (PACKED, the PackedMultiHeadAttention op): Q, K and V are the three column blocks of one
[B, S, 3*N*D] projection, so their rows are 3*N*D apart (the caller passes K and V as pointers N*D and 2*N*D
elements into it), and the Q bias comes with them. q + bq is staged through the program's own tile of Y:
stored there, a barrier, loaded back. Y's tile is this program's alone and written again only at the end,
so nothing else sees it. Why not keep q + bq in registers: Q then turns from a loaded operand of the
tensor-core dot (which the compiler keeps in shared memory) into a computed one held in registers across
the key loop, and at D=64 with 4 warps ptxas spills 152 bytes on sm_90. Why not the per-key form
(q + bq) . k_j = q . k_j + bq . k_j, a product and row sum on each K tile: it spills nothing either, but
every query block redoes it for every key, and on the H200 at BERT-base 8x2048 the kernel took 435 us
against 315 us unpacked; staged, 322 us (bench/results/session7/packed_attention_micro_*.jsonl).

Rows with no key left, and why nothing turns into NaN:
- key_bias = finfo(T).min on every key of a row (eager attention's mask of a fully padded sequence): for
  fp32 and bf16 that is -3.4e38, which times log2(e) would overflow to -inf and change the meaning; so
  finite biases saturate at -1e38 first (a bias that low drops its key all the same). A score added to
  -1.44e38 rounds away, every s_j equals m, the weights are uniform and y is the mean of V rows, as in
  the contract. (For fp16, finfo.min = -65504 is a mere shift in fp32: such a row is softmax(q K^T *
  scale) V, which is also what the float64 reference gives.)
- key_bias = -inf drops a key exactly; on every key of a row (sdpa's boolean mask), l = 0 and y = 0, as
  in the contract. Blocks where a row has seen only -inf so far (m = -inf) subtract 0 instead of m, so
  p = 2^-inf = 0 and alpha = 0 rather than -inf - -inf = NaN.
- keys past Skv in the last, partial block (the only one that loads masked) load key_bias = -inf: they
  drop out the same way.
- Skv = 0: no key block runs, l = 0 and y = 0, what the body's empty MatMul gives.
- query rows past Sq and head-dim lanes past HEAD_DIM load 0 and are never stored.

Offsets are int64: b * S * N*D passes 2^31 for long batches.

WS specs (experimental: on Hopper with ORT_TRITON_EXPERIMENTAL_WS=1, ops/attention.py `ws_enabled`) run
`_attention_ws` instead: the same maths with TMA loads and Triton's warp specialisation (its docstring says what
that pass accepts).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.attention import HEAD_DIMS, WS_ARCH, WS_HEAD_DIMS, block_config, require_ws, ws_supported

_LOG2E = tl.constexpr(1.4426950408889634)
_BIAS_FLOOR = tl.constexpr(-1e38)  # key_bias saturates here (module docstring)


@triton.jit
def _log2_key_bias(kb):
    """A block's key bias (fp32) in base-2 units. Per key, not per score: finite biases saturate at _BIAS_FLOOR
    first, so that finfo.min stays finite once scaled (module docstring)."""
    return tl.where(kb == float("-inf"), kb, tl.maximum(kb, _BIAS_FLOOR)) * _LOG2E


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, V_TY: tl.constexpr, prec: tl.constexpr):
    """One key block's scores s (base 2, -inf where a key does not count) and its V into the running (m, l,
    acc): the online softmax every attention kernel here runs."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # only -inf seen yet: p = 0, not NaN
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(V_TY), v, acc * alpha[:, None], input_precision=prec)
    return m_new, l_i, acc


@triton.jit
def _attend(q, k_ptrs, v_ptrs, kb_ptrs, start, SKV, offs_n, d_ok, m_i, l_i, acc, qk_scale,
            V_TY: tl.constexpr, MASK_KEYS: tl.constexpr, MASK_D: tl.constexpr, prec: tl.constexpr):
    """One block of BLOCK_N keys into the running (m, l, acc). The loads are masked only where they need
    to be (the last, partial key block; head-dim lanes past HEAD_DIM): a full block loads unmasked, which
    is what lets the loop pipeline at full width."""
    if MASK_KEYS:
        key_ok = start + offs_n < SKV
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        kb = tl.load(kb_ptrs, mask=key_ok, other=float("-inf")).to(tl.float32)
    else:
        if MASK_D:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        kb = tl.load(kb_ptrs).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=prec) * qk_scale + _log2_key_bias(kb)[None, :]
    return _softmax_step(s, v, m_i, l_i, acc, V_TY, prec)


@triton.jit
def _attention_ws(Q, K, V, KB, BQ, BV, Y, N, SQ, SKV, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, PACKED: tl.constexpr):
    """The same attention, warp-specialised for Hopper (WS specs: sm_90, fp16/bf16, head dims 32, 64, 128):
    TMA moves the tiles, and Triton's warp specialisation splits each program into a producer warp group
    that issues the copies and two consumer warp groups of BLOCK_M / 2 rows each, so that one block's loads,
    dots and softmax overlap the next's (FlashAttention-3's scheme; the kernel launches 3 x num_warps warps).
    What Triton 3.6's pass takes, found by compiling for sm_90 (scripts/ws_attention_compile.py): tiles
    loaded through tensor descriptors made on the device (a pointer load in the loop, even the key bias's,
    stops the pass; so do rank-4 descriptors), and the output stored through pointers (a store through a
    rank-3 descriptor stops it). Device-made descriptors live in Triton's global scratch, which the native
    launcher takes from ORT's arena.

    Q, K, V are viewed as [B, S, row stride] (3 * N * D when packed), boxes [1, rows, D] at column n * D: TMA
    fills the rows past this batch's S with zeros, so every tile loads whole. A key past SKV gets bias -inf
    (a mask per key, not per score), and its zero V row has weight 0. The key bias is viewed as [B, SKV], whose
    row stride TMA needs 16-byte aligned: WS specs are only for SKV a multiple of 16 (the aligned ones)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(SQ, BLOCK_M)
    bn = pid // num_m
    m_blk = pid - bn * num_m
    nb = tl.num_programs(0) // num_m // N  # the batch size
    b = bn // N
    n = bn % N
    hidden = N * tl.full([], HEAD_DIM, tl.int64)
    stride = hidden * 3 if PACKED else hidden
    dq = tl.make_tensor_descriptor(Q, [nb, SQ, stride], [SQ * stride, stride, 1], [1, BLOCK_M, HEAD_DIM])
    dk = tl.make_tensor_descriptor(K, [nb, SKV, stride], [SKV * stride, stride, 1], [1, BLOCK_N, HEAD_DIM])
    dv = tl.make_tensor_descriptor(V, [nb, SKV, stride], [SKV * stride, stride, 1], [1, BLOCK_N, HEAD_DIM])
    dkb = tl.make_tensor_descriptor(KB, [nb, SKV], [SKV, 1], [1, BLOCK_N])
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = dq.load([b, m_blk * BLOCK_M, n * HEAD_DIM]).reshape(BLOCK_M, HEAD_DIM)
    if PACKED:  # Q's bias in registers: each consumer warp group holds half the tile
        bq = tl.load(BQ + n * HEAD_DIM + offs_d).to(tl.float32)
        q = (q.to(tl.float32) + bq[None, :]).to(Q.dtype.element_ty)
    qk_scale = scale * _LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in tl.range(0, SKV, BLOCK_N, warp_specialize=True):
        k = dk.load([b, start, n * HEAD_DIM]).reshape(BLOCK_N, HEAD_DIM)
        v = dv.load([b, start, n * HEAD_DIM]).reshape(BLOCK_N, HEAD_DIM)
        kb = _log2_key_bias(dkb.load([b, start]).reshape(BLOCK_N).to(tl.float32))
        kb = tl.where(start + offs_n < SKV, kb, float("-inf"))  # past SKV: the next batch's keys, or zeros
        s = tl.dot(q, tl.trans(k)) * qk_scale + kb[None, :]
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, V.dtype.element_ty, "tf32")  # fp16/bf16: moot
    bv = tl.load(BV + n * HEAD_DIM + offs_d).to(tl.float32)
    y = tl.where((l_i > 0.0)[:, None], acc / l_i[:, None] + bv[None, :], 0.0)
    y_ptrs = Y + (b * SQ + offs_m).to(tl.int64)[:, None] * hidden + n * HEAD_DIM + offs_d[None, :]
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=(offs_m < SQ)[:, None])


@triton.jit
def attention_fwd(
    Q, K, V, KB, BQ, BV, Y, N, SQ, SKV, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PACKED: tl.constexpr = False, WS: tl.constexpr = False,
):
    if WS:  # Hopper: TMA and warp specialisation (_attention_ws), head dims that are powers of two
        tl.static_assert(BLOCK_D == HEAD_DIM)
        _attention_ws(Q, K, V, KB, BQ, BV, Y, N, SQ, SKV, scale, HEAD_DIM, BLOCK_M, BLOCK_N, PACKED)
        return
    # One flat grid of cdiv(SQ, BLOCK_M) * B * N programs (no 65535 limit on grid.x), the query block
    # varying fastest: the programs of one head run side by side and share its K/V in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(SQ, BLOCK_M)
    bn = pid // num_m
    m_blk = pid - bn * num_m
    b = (bn // N).to(tl.int64)
    n = (bn % N).to(tl.int64)
    # row stride of Q, K, V, Y, in int64; N may arrive as a plain 1 (Triton's JIT specialises ints equal to 1)
    hidden = N * tl.full([], HEAD_DIM, tl.int64)
    # the row stride of Q, K, V: 3 * hidden when they are column blocks of one packed projection, whose
    # Q bias the kernel adds (module docstring)
    stride = hidden * 3 if PACKED else hidden
    # fp32 dots in 3xTF32; for fp16/bf16 the precision argument is moot
    prec: tl.constexpr = "tf32x3" if Q.dtype.element_ty == tl.float32 else "tf32"
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # BLOCK_D is HEAD_DIM rounded up to a power of two
    q_rows = (b * SQ + offs_m)[:, None]
    q_mask = (offs_m < SQ)[:, None] & d_ok[None, :]
    q = tl.load(Q + q_rows * stride + n * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
    head_offs = n * HEAD_DIM + offs_d  # this head's lanes of a [N*D] vector (q_bias, v_bias)
    y_ptrs = Y + q_rows * hidden + n * HEAD_DIM + offs_d[None, :]
    if PACKED:
        # q + bq staged through this program's own tile of Y (written only at the end): reloaded, Q is a
        # loaded operand again, which the dot takes from shared memory (module docstring)
        bq = tl.load(BQ + head_offs, mask=d_ok, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (q.to(tl.float32) + bq[None, :]).to(Y.dtype.element_ty), mask=q_mask)
        tl.debug_barrier()
        q = tl.load(y_ptrs, mask=q_mask, other=0.0)

    kv_offs = (b * SKV + offs_n)[:, None] * stride + n * HEAD_DIM + offs_d[None, :]
    k_ptrs, v_ptrs = K + kv_offs, V + kv_offs
    kb_ptrs = KB + b * SKV + offs_n
    qk_scale = scale * _LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end = (SKV // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):  # whole key blocks
        m_i, l_i, acc = _attend(q, k_ptrs, v_ptrs, kb_ptrs, start, SKV, offs_n, d_ok, m_i, l_i, acc, qk_scale,
                                V.dtype.element_ty, False, MASK_D, prec)
        k_ptrs += BLOCK_N * stride
        v_ptrs += BLOCK_N * stride
        kb_ptrs += BLOCK_N
    if full_end < SKV:  # the partial last block
        m_i, l_i, acc = _attend(q, k_ptrs, v_ptrs, kb_ptrs, full_end, SKV, offs_n, d_ok, m_i, l_i, acc, qk_scale,
                                V.dtype.element_ty, True, MASK_D, prec)

    # every key -inf, or SKV == 0 (l = 0): y is 0, without v_bias (the graph's row is 0 there too)
    bv = tl.load(BV + head_offs, mask=d_ok, other=0.0).to(tl.float32)
    y = tl.where((l_i > 0.0)[:, None], acc / l_i[:, None] + bv[None, :], 0.0)
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=q_mask)


# ---- torch entry points: the same kernel through Triton's JIT (tests, interpreter, GPU timing) ---------
def attention(q, k, v, key_bias, num_heads, scale, *, k_bias=None, v_bias=None, out=None,
              config: dict | None = None):
    """Y for q [B, Sq, N*D], k and v [B, Skv, N*D], key_bias [B, Skv], biases [N*D] (zeros if None; all one
    dtype). k_bias is checked but not read: it cancels in the softmax (ops/attention.py). `out` lets a
    test hand in a poisoned buffer; `config` overrides block_config's BLOCK_M, BLOCK_N, num_warps,
    num_stages (tests use small blocks so several key blocks run)."""
    import torch

    b, sq, hidden, d = _check_heads("attention", "q [B, Sq, N*D]", q, num_heads)
    if k.dim() != 3 or k.shape[0] != b or k.shape[2] != hidden:
        raise ValueError(f"attention: k must be [B={b}, Skv, {hidden}], got {list(k.shape)}")
    skv = k.shape[1]
    _check_like("attention", q, (("k", k, (b, skv, hidden)), ("v", v, (b, skv, hidden)),
                                 ("key_bias", key_bias, (b, skv)), ("out", out, (b, sq, hidden)),
                                 ("k_bias", k_bias, (hidden,)), ("v_bias", v_bias, (hidden,))), out)
    q, k, v, key_bias = q.contiguous(), k.contiguous(), v.contiguous(), key_bias.contiguous()
    v_bias = torch.zeros(hidden, dtype=q.dtype, device=q.device) if v_bias is None else v_bias.contiguous()
    y = out if out is not None else torch.empty_like(q)
    _launch(q, k, v, key_bias, v_bias, v_bias, y, num_heads, sq, skv, scale, d, config, packed=False)
    return y


def packed_attention(qkv, key_bias, bias, num_heads, scale, *, out=None, config: dict | None = None):
    """Y [B, S, N*D] for qkv [B, S, 3*N*D] (Q, K, V side by side), key_bias [B, S] and bias [3*N*D] (Q's,
    K's and V's; K's is checked but not read, it cancels). `out` and `config` as for `attention`."""
    b, s, packed, d = _check_heads("packed_attention", "qkv [B, S, 3*N*D]", qkv, num_heads, parts=3)
    hidden = packed // 3
    _check_like("packed_attention", qkv, (("key_bias", key_bias, (b, s)), ("bias", bias, (packed,)),
                                          ("out", out, (b, s, hidden))), out)
    qkv, key_bias, bias = qkv.contiguous(), key_bias.contiguous(), bias.contiguous()
    y = out if out is not None else qkv.new_empty((b, s, hidden))
    # K and V start hidden and 2 * hidden elements into each row (views: the kernel reads only data_ptr)
    _launch(qkv, qkv[..., hidden:], qkv[..., 2 * hidden:], key_bias, bias, bias[2 * hidden:], y, num_heads, s, s,
            scale, d, config, packed=True)
    return y


def _check_heads(fn: str, what: str, x, num_heads, parts: int = 1) -> tuple[int, int, int, int]:
    """(B, S, width, D) of a [B, S, parts * heads * D] input whose head dim the kernel takes, or the error."""
    import torch

    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{fn}: dtype {x.dtype} not supported (float32, float16, bfloat16)")
    if x.dim() != 3:
        name, shape = what.split(" ", 1)
        raise ValueError(f"{fn}: {name} must be {shape}, got shape {list(x.shape)}")
    b, s, width = x.shape
    if not isinstance(num_heads, int) or num_heads < 1 or width % (parts * num_heads):
        raise ValueError(f"{fn}: num_heads={num_heads!r} must be a positive int dividing the hidden size "
                         f"{width // parts}" + (f" (dim 2 is {width}: Q, K, V side by side)" if parts > 1 else ""))
    d = width // (parts * num_heads)
    if d not in HEAD_DIMS:
        raise ValueError(f"{fn}: head dim {d} (hidden {width // parts} / {num_heads} heads) not supported "
                         f"(head dims {', '.join(map(str, HEAD_DIMS))})")
    return b, s, width, d


def _check_like(fn: str, ref, named, out) -> None:
    """Each (name, tensor or None, shape) must be ref's dtype and device at that shape; out contiguous."""
    for name, t, shape in named:
        if t is not None and (tuple(t.shape) != shape or t.dtype != ref.dtype or t.device != ref.device):
            raise ValueError(f"{fn}: {name} must be {ref.dtype} of shape {list(shape)} on {ref.device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    if out is not None and not out.is_contiguous():
        raise ValueError(f"{fn}: out must be contiguous")


def _launch(q, k, v, key_bias, q_bias, v_bias, y, num_heads, sq, skv, scale, d, config, *, packed: bool):
    import torch

    type_name = {torch.float32: "float", torch.float16: "float16", torch.bfloat16: "bfloat16"}[q.dtype]
    cfg = block_config(d, type_name)
    cfg.update(config or {})
    ws = bool(cfg.get("WS", False))
    if ws:
        if q.device.type != "cpu":  # the interpreter runs its maths, not its warp groups
            require_ws()
        # the interpreter (CPU tests) runs it as any GPU would
        major, minor = (WS_ARCH // 10, 0) if q.device.type == "cpu" else torch.cuda.get_device_capability(q.device)
        arch = 10 * major + minor
        if not ws_supported(d, type_name, arch, packed) or skv % 16:
            raise ValueError(f"attention: the warp-specialised kernel (WS) takes fp16/bf16 at head dims "
                             f"{', '.join(map(str, WS_HEAD_DIMS))} (not packed at 128) and key counts that are "
                             f"multiples of 16, on sm_{WS_ARCH} on; got {type_name}, head dim {d}, {skv} keys, "
                             f"sm_{arch}")
        # Triton's global scratch, where the kernel makes its tensor descriptors
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=q.device))
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]) * q.shape[0] * num_heads,)
    if grid[0]:
        attention_fwd[grid](q, k, v, key_bias, q_bias, v_bias, y, num_heads, sq, skv, float(scale),
                            HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                            PACKED=packed, WS=ws, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
