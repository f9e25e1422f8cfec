/* qkv_rotary_cache.c: planner and kernel parameters for QKVRotaryCache, QKVNormRotaryCache and QKVCache (contracts:
 * ort_triton/ops/qkv_rotary_cache.py, ort_triton/ops/qkv_cache.py; kernels: ort_triton/kernels/qkv_rotary_cache.py,
 * one body, its rotary and bias constexpr switches).
 *
 * QKVRotaryCache inputs: QKV [B, S, (Nq + 2 Nkv) D]; cos, sin as Rotary's; past_key, past_value [B, Nkv, P, D].
 *   Attributes (contract order): interleaved, rotary_dim (Rotary's, checked by ot_rotary_cos), seq_major.
 * QKVNormRotaryCache inputs: QKVRotaryCache's, then q_gamma, k_gamma [D]. Attributes: Rotary's, epsilon, seq_major.
 * QKVCache inputs: QKV; bias [(Nq + 2 Nkv) D]; past_key, past_value. Attributes: seq_major.
 * Outputs (all): Q [B, Nq, S, D]; present_key, present_value [B, Nkv, P + S, D].
 * seq_major (ops/kv_layout.py): past [P, B, Nkv, D], present [P + S, B, Nkv, D]; the copy of the past is then one
 * block a tensor, taken by at most COPY_PROGRAMS programs each, and skipped for a present whose memory is its past's
 * (those programs are then not launched: ot_plan.alias_grid0; the kernel's copy bits say the same).
 * Dispatch keys: Rotary's (D, both D and W multiples of 16, half_split); QKVCache's the first two (W = D);
 * consts = (BLOCK_S, BLOCK_D, BLOCK_C, COPY_PROGRAMS).
 * Grid: one flat axis, n_new = ceil(S / BLOCK_S) * (Nq + 2 Nkv) * B programs for the new rows, then
 * 2 * B * Nkv * ceil(P * D / BLOCK_C) for the copy of the past (seq_major: 2 * min(ceil(P B Nkv D / BLOCK_C),
 * COPY_PROGRAMS)). */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "ot_table.h"
#include "planner_util.h"

/* The three ops' inputs by role: QKVRotaryCache (QKV, cos, sin, past_key, past_value), QKVNormRotaryCache (those,
 * q_gamma, k_gamma) and QKVCache (QKV, bias, past_key, past_value); -1 where an op has no such input. */
typedef struct {
  const char *name;
  int qkv, bias, cos, sin, past_key, past_value, q_gamma, k_gamma, n_inputs, n_attrs, attr_seq_major;
} qkv_op;
static const qkv_op QKV_ROTARY = {"QKVRotaryCache", 0, -1, 1, 2, 3, 4, -1, -1, 5, 3, 2};
static const qkv_op QKV_NORM_ROTARY = {"QKVNormRotaryCache", 0, -1, 1, 2, 3, 4, 5, 6, 7, 4, 3};
static const qkv_op QKV_CACHE = {"QKVCache", 0, 1, -1, -1, 2, 3, -1, -1, 4, 1, 0};
enum { ATTR_EPSILON = 2 }; /* QKVNormRotaryCache's, after Rotary's two */
enum { OUT_Q, OUT_PRESENT_KEY, OUT_PRESENT_VALUE, N_OUTPUTS };
enum { KEY_HEAD_DIM, KEY_ALIGNED, KEY_HALF_SPLIT, N_KEYS };
enum { CONST_BLOCK_S, CONST_BLOCK_D, CONST_BLOCK_C, CONST_COPY_PROGRAMS };

typedef struct {
  ot_rotary_shape rope; /* batch, seq, d (heads: Nq); the rotary's r, w, cos strides (QKVCache: r = w = d, 0) */
  int64_t nkv, past;
  int seq_major;
} qrc_shape;

static int shape_of(const ot_op *op, const qkv_op *k, const ot_desc *in, const double *attrs, qrc_shape *out,
                    char *err, size_t err_len) {
  const ot_desc *qkv = &in[k->qkv], *pk = &in[k->past_key], *pv = &in[k->past_value];
  const char *qn = op->inputs[k->qkv].name, *kn = op->inputs[k->past_key].name;
  char a[160], b[160];
  const int sm = ot_kv_seq_major(attrs[k->attr_seq_major], "the cache [B, kv_num_heads, P, head_dim]",
                                 "[P, B, kv_num_heads, head_dim]", err, err_len);
  if (sm < 0) return 1;
  /* dims of past_key by role: batch, kv heads, positions */
  const int dim_b = sm ? 1 : 0, dim_n = sm ? 2 : 1, dim_p = sm ? 0 : 2;
  if (qkv->rank != 3 || qkv->dims[0] < 0 || qkv->dims[1] < 0 || qkv->dims[2] < 0) {
    snprintf(err, err_len, "input %s has shape %s; it must be [B, S, (num_heads + 2 * kv_num_heads) * head_dim]", qn,
             ot_shape_text(qkv, a, sizeof a));
    return 1;
  }
  if (pk->rank != 4 || pk->dims[dim_b] != qkv->dims[0] || pk->dims[dim_n] < 1 || pk->dims[dim_p] < 0 ||
      pk->dims[3] < 1) {
    snprintf(err, err_len, "input %s has shape %s; it must be %s with B = %lld (dim 0 of input %s)", kn,
             ot_shape_text(pk, a, sizeof a), sm ? "[P, B, kv_num_heads, head_dim] (seq_major)"
                                                : "[B, kv_num_heads, P, head_dim]", (long long)qkv->dims[0], qn);
    return 1;
  }
  if (pv->rank != 4 || memcmp(pv->dims, pk->dims, 4 * sizeof pk->dims[0]) != 0) {
    snprintf(err, err_len, "input %s has shape %s but input %s has shape %s; they must be equal",
             op->inputs[k->past_value].name, ot_shape_text(pv, a, sizeof a), kn, ot_shape_text(pk, b, sizeof b));
    return 1;
  }
  const int64_t d = pk->dims[3], nkv = pk->dims[dim_n], width = qkv->dims[2];
  if (nkv > 65535 || width % d != 0 || width / d <= 2 * nkv) {
    snprintf(err, err_len, "input %s has shape %s: its last dim must be (num_heads + 2 * %lld) * %lld with num_heads "
                           ">= 1 (kv_num_heads and head_dim from input %s, %s)", qn, ot_shape_text(qkv, a, sizeof a),
             (long long)nkv, (long long)d, kn, ot_shape_text(pk, b, sizeof b));
    return 1;
  }
  if (k->bias >= 0 && ot_check_vector(op, in, k->bias, width, err, err_len)) return 1; /* [(Nq + 2 Nkv) D] */
  for (int g = 0; k->q_gamma >= 0 && g < 2; g++) { /* q_gamma, k_gamma: [D] each */
    const int i = g ? k->k_gamma : k->q_gamma;
    if (in[i].rank != 1 || in[i].dims[0] != d) {
      snprintf(err, err_len, "input %s has shape %s; it must be [%lld], head_dim (dim 3 of input %s)",
               op->inputs[i].name, ot_shape_text(&in[i], a, sizeof a), (long long)d, kn);
      return 1;
    }
  }
  out->nkv = nkv, out->past = pk->dims[dim_p], out->seq_major = sm;
  out->rope.batch = qkv->dims[0], out->rope.seq = qkv->dims[1], out->rope.d = d, out->rope.heads = width / d - 2 * nkv;
  if (k->cos < 0) {
    out->rope.r = out->rope.w = d, out->rope.cos_b = out->rope.cos_s = 0;
    return 0;
  }
  return ot_rotary_cos(op, in, k->qkv, k->cos, k->sin, attrs, &out->rope, err, err_len);
}

static int plan_qkv(const ot_op *op, const qkv_op *k, const ot_desc *in, int n_inputs, int n_outputs,
                    const double *attrs, ot_plan *plan, char *err, size_t err_len) {
  if (n_inputs != k->n_inputs || n_outputs != N_OUTPUTS || op->n_attrs != k->n_attrs) {
    snprintf(err, err_len, "the kernel table gives this op %d inputs, %d outputs and %d attributes, the "
                           "%s planner expects %d, 3 and %d; the library is inconsistent, rebuild it",
             n_inputs, n_outputs, op->n_attrs, k->name, k->n_inputs, k->n_attrs);
    return 1;
  }
  qrc_shape sh;
  if (shape_of(op, k, in, attrs, &sh, err, err_len)) return 1;
  const int64_t d = sh.rope.d, batch = sh.rope.batch, seq = sh.rope.seq, nq = sh.rope.heads;
  const int64_t keys[N_KEYS] = {d, d % 16 == 0 && sh.rope.w % 16 == 0,
                                k->cos >= 0 && !attrs[OT_ROTARY_INTERLEAVED] && sh.rope.r == d};
  const ot_spec *spec = ot_find_spec(op, keys, k->cos >= 0 ? N_KEYS : KEY_HALF_SPLIT, plan->arch); /* QKVCache: 2 */
  if (!spec) {
    snprintf(err, err_len, "head_dim %lld (dim 3 of input %s) is not supported; this library's kernels take "
                           "head_dim up to %lld", (long long)d, op->inputs[k->past_key].name,
             op->n_specs ? (long long)op->specs[op->n_specs - 1].key_max[KEY_HEAD_DIM] : 0LL);
    return 1;
  }
  const int64_t block_s = spec->consts[CONST_BLOCK_S], block_d = spec->consts[CONST_BLOCK_D],
                block_c = spec->consts[CONST_BLOCK_C], copy_programs = spec->consts[CONST_COPY_PROGRAMS];
  if (block_s < 1 || block_d < d || block_c < 1 || copy_programs < 1) {
    snprintf(err, err_len, "kernel %s has BLOCK_S=%lld, BLOCK_D=%lld, BLOCK_C=%lld in the kernel table for head_dim "
                           "%lld; rebuild the library", spec->kernel_name, (long long)block_s, (long long)block_d,
             (long long)block_c, (long long)d);
    return 1;
  }
  /* every count below int32 (the kernel's program ids and its int32 arguments); each factor checked first */
  const int64_t heads = nq + 2 * sh.nkv, s_blocks = (seq + block_s - 1) / block_s;
  const int64_t per_slab = (sh.past * d + block_c - 1) / block_c;
  /* sequence first: one block of P B Nkv D elements a tensor (below int64's reach: each factor is int32) */
  const int64_t copy_blocks = sh.past ? (sh.past * d * batch * sh.nkv + block_c - 1) / block_c : 0;
  const int64_t copies = sh.seq_major ? 2 * (copy_blocks < copy_programs ? copy_blocks : copy_programs)
                                      : 2 * batch * sh.nkv * per_slab;
  const int64_t limit = INT32_MAX;
  if (seq > limit - block_s || sh.past > limit - seq || batch > limit / heads ||
      (s_blocks && batch * heads > limit / s_blocks) || sh.past * d > limit ||
      (per_slab && 2 * batch * sh.nkv > limit / per_slab) || s_blocks * heads * batch > limit - copies) {
    snprintf(err, err_len, "inputs %s %lld x %lld x %lld heads and a cache of %lld need more than 2^31 programs or "
                           "elements a head; split the batch", op->inputs[k->qkv].name, (long long)batch,
             (long long)seq, (long long)heads, (long long)sh.past);
    return 1;
  }
  const int64_t n_new = s_blocks * heads * batch;
  plan->spec = spec;
  plan->grid[0] = (unsigned)(n_new + copies);
  plan->grid[1] = plan->grid[2] = 1;
  plan->values[0] = n_new;
  if (sh.seq_major && copies) { /* a present bound over its past: the new rows' programs only */
    plan->n_alias = 2;
    plan->alias_in[0] = k->past_key, plan->alias_in[1] = k->past_value;
    plan->alias_out[0] = OUT_PRESENT_KEY, plan->alias_out[1] = OUT_PRESENT_VALUE;
    plan->alias_grid0 = (unsigned)n_new;
  }
  ot_desc *q = &plan->outputs[OUT_Q], *pk = &plan->outputs[OUT_PRESENT_KEY], *pv = &plan->outputs[OUT_PRESENT_VALUE];
  *q = in[k->past_key];
  q->dims[0] = batch, q->dims[1] = nq, q->dims[2] = seq; /* [B, Nq, S, D] */
  *pk = in[k->past_key];
  pk->dims[sh.seq_major ? 0 : 2] = sh.past + seq;
  *pv = *pk;
  return 0;
}

/* The kernels' last three parameters: B, seq_major and the copy bits (bit j for the plan's alias pair j: 0 the key's
 * past, 1 the value's; a present whose memory is its past's, bound so by the caller, has nothing to copy; heads first
 * has no pairs and always copies). */
static int layout_params(const qkv_op *k, const ot_plan *plan, const qrc_shape *sh, void *const *ptrs, uint64_t *slot,
                         void **params, int n) {
  int32_t copy = 3;
  for (int j = 0; j < plan->n_alias; j++)
    if (ptrs[k->n_inputs + plan->alias_out[j]] == ptrs[plan->alias_in[j]]) copy &= ~(1 << j);
  const int32_t v[3] = {(int32_t)sh->rope.batch, sh->seq_major, copy};
  for (int i = 0; i < 3; i++) ot_put_param(slot, params, n++, &v[i], sizeof v[i]);
  return n;
}

int ot_qkv_rotary_cache_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                             ot_plan *plan, char *err, size_t err_len) {
  return plan_qkv(op, &QKV_ROTARY, in, n_inputs, n_outputs, attrs, plan, err, err_len);
}

/* QKVRotaryCache's and QKVNormRotaryCache's parameters: the inputs, the outputs, NQ .. n_new, and the norm's eps */
static int rotary_params(const ot_op *op, const qkv_op *k, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                         const double *attrs, void *storage, void **params) {
  qrc_shape sh;
  char err[8];
  if (shape_of(op, k, in, attrs, &sh, err, sizeof err)) return -1; /* the plan has checked them */
  const int32_t v[11] = {(int32_t)sh.rope.heads, (int32_t)sh.nkv, (int32_t)sh.rope.seq, (int32_t)sh.past,
                         (int32_t)sh.rope.d, (int32_t)sh.rope.r, (int32_t)sh.rope.cos_b, (int32_t)sh.rope.cos_s,
                         sh.rope.w != sh.rope.r, (int32_t)attrs[OT_ROTARY_INTERLEAVED], (int32_t)plan->values[0]};
  uint64_t *slot = storage;
  int n = 0;
  for (int i = 0; i < k->n_inputs + N_OUTPUTS; i++) /* the inputs, then the outputs */
    ot_put_param(slot, params, n++, &ptrs[i], sizeof ptrs[i]);
  for (int i = 0; i < 11; i++) ot_put_param(slot, params, n++, &v[i], sizeof v[i]); /* NQ .. n_new */
  if (k->q_gamma >= 0) {
    const float eps = (float)attrs[ATTR_EPSILON];
    ot_put_param(slot, params, n++, &eps, sizeof eps);
  }
  return layout_params(k, plan, &sh, ptrs, slot, params, n);
}

int ot_qkv_rotary_cache_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                               const double *attrs, void *storage, void **params) {
  return rotary_params(op, &QKV_ROTARY, plan, in, ptrs, attrs, storage, params);
}

int ot_qkv_norm_rotary_cache_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs,
                                  const double *attrs, ot_plan *plan, char *err, size_t err_len) {
  return plan_qkv(op, &QKV_NORM_ROTARY, in, n_inputs, n_outputs, attrs, plan, err, err_len);
}

int ot_qkv_norm_rotary_cache_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                                    const double *attrs, void *storage, void **params) {
  return rotary_params(op, &QKV_NORM_ROTARY, plan, in, ptrs, attrs, storage, params);
}

int ot_qkv_cache_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                      ot_plan *plan, char *err, size_t err_len) {
  return plan_qkv(op, &QKV_CACHE, in, n_inputs, n_outputs, attrs, plan, err, err_len);
}

int ot_qkv_cache_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                        const double *attrs, void *storage, void **params) {
  qrc_shape sh;
  char err[8];
  if (shape_of(op, &QKV_CACHE, in, attrs, &sh, err, sizeof err)) return -1; /* the plan has checked them */
  const int32_t v[6] = {(int32_t)sh.rope.heads, (int32_t)sh.nkv, (int32_t)sh.rope.seq, (int32_t)sh.past,
                        (int32_t)sh.rope.d, (int32_t)plan->values[0]};
  uint64_t *slot = storage;
  int n = 0;
  for (int i = 0; i < QKV_CACHE.n_inputs + N_OUTPUTS; i++) /* the inputs, then the outputs */
    ot_put_param(slot, params, n++, &ptrs[i], sizeof ptrs[i]);
  for (int i = 0; i < 6; i++) ot_put_param(slot, params, n++, &v[i], sizeof v[i]); /* NQ, NKV, S, P, D, n_new */
  return layout_params(&QKV_CACHE, plan, &sh, ptrs, slot, params, n);
}
