/* causal_attention.c: planner and kernel parameters for CausalAttention (contract:
 * ort_triton/ops/causal_attention.py; kernel: ort_triton/kernels/causal_attention.py).
 *
 * Inputs:  Q [B, Nq, S, D], K and V [B, Nkv, T, D] (T >= S, Nq % Nkv == 0; seq_major: [T, B, Nkv, D]), key_bias [B, T]
 * Output:  Y [B, S, Nq * D]
 * Attributes (contract order): scale, masked_rows (0 or 1), seq_major (0 or 1: the cache's layout, ops/kv_layout.py).
 * Dispatch keys: the head dim D (exact), the packed rows G * S of one program (G = Nq / Nkv): the decode spec
 * for rows up to the contract's DECODE_ROWS, the prefill spec beyond; B * Nkv and T (the built-in specs take
 * any; a tuning table's narrow them to buckets); seq_major (a spec of its own for each layout).
 * Spec consts = (BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, SPLIT_TARGET, SPLIT_MIN_KEYS, FUSED_MERGE).
 * Grid: one flat axis of ceil(G * S / BLOCK_M) * B * Nkv programs, the row block fastest. A spec with a split
 * target below which the programs fall splits the cache into chunks (split_keys in the contract, mirrored
 * by split_keys here): launch 0 runs programs * chunks (PHASE 1, chunk states into the workspace),
 * launch 1 the programs again (PHASE 2, the merge and Y). A FUSED_MERGE spec offers the generic code to run both
 * as one launch over merge counters (plan->merge_counters, one a row tile): PHASE 3 on the first grid, where the
 * last chunk of each row tile merges.
 * The generic code (ort_triton.c) has already checked presence of inputs and element types. */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "ot_table.h"
#include "planner_util.h"

enum { IN_Q, IN_K, IN_V, IN_KEY_BIAS, N_INPUTS };
enum { ATTR_SCALE, ATTR_MASKED_ROWS, ATTR_SEQ_MAJOR, N_ATTRS };
enum { KEY_HEAD_DIM, KEY_ROWS, KEY_BATCH_KV_HEADS, KEY_KEYS, KEY_SEQ_MAJOR, N_KEYS };
enum {
  CONST_BLOCK_M, CONST_BLOCK_N, CONST_HEAD_DIM, CONST_BLOCK_D, CONST_SPLIT_TARGET, CONST_SPLIT_MIN_KEYS,
  CONST_FUSED_MERGE
};
enum { VALUE_SPLIT }; /* plan->values: keys per chunk, 0 for one pass */

/* The contract's split_keys (ops/causal_attention.py): keys per chunk, 0 for one pass. */
static int64_t split_keys(int64_t t, int64_t programs, int64_t block_n, int64_t target, int64_t min_keys) {
  const int64_t want = target > 0 && programs > 0 ? target / programs : 0;
  if (want < 2 || t <= min_keys) return 0;
  int64_t chunk = (t + want - 1) / want;
  if (chunk < min_keys) chunk = min_keys;
  chunk = (chunk + block_n - 1) / block_n * block_n;
  return chunk < t ? chunk : 0;
}

int ot_causal_attention_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                             ot_plan *plan, char *err, size_t err_len) {
  if (n_inputs != N_INPUTS || n_outputs != 1 || op->n_attrs != N_ATTRS) {
    snprintf(err, err_len, "the kernel table gives this op %d inputs, %d outputs and %d attributes, the causal "
                           "attention planner expects 4, 1 and 3; the library is inconsistent, rebuild it",
             n_inputs, n_outputs, op->n_attrs);
    return 1;
  }
  const int sm = ot_kv_seq_major(attrs[ATTR_SEQ_MAJOR], "K, V [B, Nkv, T, D]", "[T, B, Nkv, D]", err, err_len);
  if (sm < 0) return 1;
  const char *kv_layout = sm ? "[T, B, Nkv, D] (seq_major)" : "[B, Nkv, T, D]";
  if (ot_check_rank(op, in, IN_Q, 4, "[B, Nq, S, D]", err, err_len) ||
      ot_check_rank(op, in, IN_K, 4, kv_layout, err, err_len) || ot_check_rank(op, in, IN_V, 4, kv_layout, err, err_len))
    return 1;
  const ot_desc *q = &in[IN_Q], *k = &in[IN_K], *v = &in[IN_V], *kb = &in[IN_KEY_BIAS];
  const char *q_name = op->inputs[IN_Q].name, *k_name = op->inputs[IN_K].name;
  char a[160], b[160];
  if (memcmp(v->dims, k->dims, 4 * sizeof k->dims[0]) != 0) {
    snprintf(err, err_len, "input %s has shape %s but input %s has shape %s; they must be equal",
             op->inputs[IN_V].name, ot_shape_text(v, a, sizeof a), k_name, ot_shape_text(k, b, sizeof b));
    return 1;
  }
  const int64_t batch = q->dims[0], nq = q->dims[1], s = q->dims[2], head_dim = q->dims[3];
  const int64_t nkv = k->dims[sm ? 2 : 1], t = k->dims[sm ? 0 : 2];
  if (k->dims[sm ? 1 : 0] != batch || k->dims[3] != head_dim) {
    snprintf(err, err_len, "input %s has shape %s but input %s has shape %s; they must agree in batch (dim %d of %s, "
                           "0 of %s) and head dim (dim 3)",
             k_name, ot_shape_text(k, a, sizeof a), q_name, ot_shape_text(q, b, sizeof b), sm, k_name, q_name);
    return 1;
  }
  if (nkv < 1 || nq % nkv != 0) {
    snprintf(err, err_len, "input %s has %lld query heads and input %s %lld key/value heads; the key/value heads "
                           "must be at least 1 and divide the query heads (grouped-query attention)",
             q_name, (long long)nq, k_name, (long long)nkv);
    return 1;
  }
  if (t < s) {
    snprintf(err, err_len, "input %s holds T=%lld keys (dim %d), fewer than the S=%lld queries of input %s; K and V "
                           "must be the present cache, the new keys included",
             k_name, (long long)t, sm ? 0 : 2, (long long)s, q_name);
    return 1;
  }
  if (kb->rank != 2 || kb->dims[0] != batch || kb->dims[1] != t) {
    snprintf(err, err_len, "input %s has shape %s; it must be [%lld,%lld], [B, T] of inputs %s and %s",
             op->inputs[IN_KEY_BIAS].name, ot_shape_text(kb, a, sizeof a), (long long)batch, (long long)t, q_name,
             k_name);
    return 1;
  }
  const double rows_attr = attrs[ATTR_MASKED_ROWS];
  if (rows_attr != 0 && rows_attr != 1) {
    snprintf(err, err_len, "attribute masked_rows=%g must be 0 (a row that sees no key is 0) or 1 (the mean of V)",
             rows_attr);
    return 1;
  }
  /* the kernel's int32 arithmetic: query heads, packed rows G * S and a block past them, a head's T * D
   * elements and a block past them (sequence first, rows B * Nkv * D apart: T * B * Nkv * D); Nq * D is the
   * output's row */
  const int64_t group = nq / nkv;
  if (nq > INT32_MAX || s > INT32_MAX / 2 || t > INT32_MAX / 2 || (group > 0 && s > (INT32_MAX / 2) / group) ||
      batch > INT32_MAX / nkv || (t + 256) * head_dim > INT32_MAX / (sm ? batch * nkv : 1) ||
      nq * head_dim > INT32_MAX) {
    snprintf(err, err_len, "shapes Q %s, K %s are past this kernel's 32-bit indexing (G * S, T * D%s and Nq * D must "
                           "stay under 2^31)",
             ot_shape_text(q, a, sizeof a), ot_shape_text(k, b, sizeof b), sm ? " * B * Nkv" : "");
    return 1;
  }
  const int64_t rows = group * s;
  const int64_t keys[N_KEYS] = {head_dim, rows, batch * nkv, t, sm};
  const ot_spec *spec = ot_find_spec(op, keys, N_KEYS, plan->arch);
  if (!spec) {
    char dims[256];
    ot_key_values(op, N_KEYS, KEY_HEAD_DIM, dims, sizeof dims);
    if (!dims[0])
      snprintf(err, err_len, "this library holds no kernels for this op; rebuild it with the op included");
    else
      snprintf(err, err_len, "head dim %lld (dim 3 of input %s) is not supported; this library has kernels for head "
                             "dims %s (the rewriter should not have fused this node)",
               (long long)head_dim, q_name, dims);
    return 1;
  }
  const int64_t block_m = spec->consts[CONST_BLOCK_M], block_n = spec->consts[CONST_BLOCK_N];
  const int64_t block_d = spec->consts[CONST_BLOCK_D];
  if (block_m < 1 || block_n < 1 || block_n > 256 || spec->consts[CONST_HEAD_DIM] != head_dim ||
      block_d < head_dim || block_d > 256) {
    snprintf(err, err_len, "kernel %s has BLOCK_M=%lld, BLOCK_N=%lld, HEAD_DIM=%lld, BLOCK_D=%lld in the kernel "
                           "table for head dim %lld; rebuild the library",
             spec->kernel_name, (long long)block_m, (long long)block_n, (long long)spec->consts[CONST_HEAD_DIM],
             (long long)block_d, (long long)head_dim);
    return 1;
  }
  int64_t programs; /* ceil(G * S / BLOCK_M) * B * Nkv */
  if (ot_grid_programs(rows, block_m, batch, nkv, "G * S", "Nkv", &programs, err, err_len)) return 1;

  plan->spec = spec;
  plan->grid[0] = (unsigned)programs; /* 0 for an empty batch or S = 0: the caller skips the launch */
  plan->grid[1] = 1;
  plan->grid[2] = 1;
  plan->n_launches = 1;
  const int64_t split = programs ? split_keys(t, programs, block_n, spec->consts[CONST_SPLIT_TARGET],
                                                   spec->consts[CONST_SPLIT_MIN_KEYS])
                                      : 0;
  plan->values[VALUE_SPLIT] = split;
  if (split) { /* T > split >= BLOCK_N, so 2 <= chunks <= T: no overflow below */
    const int64_t chunks = (t + split - 1) / split;
    if (programs > INT32_MAX / chunks) {
      snprintf(err, err_len, "shapes Q %s, K %s split into %lld chunks need more than 2^31 programs",
               ot_shape_text(q, a, sizeof a), ot_shape_text(k, b, sizeof b), (long long)chunks);
      return 1;
    }
    plan->grid[0] = (unsigned)(programs * chunks);
    plan->n_launches = 2;
    plan->grid2[0] = (unsigned)programs;
    plan->grid2[1] = 1;
    plan->grid2[2] = 1;
    plan->scratch_bytes = (size_t)(programs * chunks * block_m * (block_d + 2)) * sizeof(float);
    if (spec->consts[CONST_FUSED_MERGE] && programs <= OT_MERGE_COUNTERS) plan->merge_counters = (size_t)programs;
  }
  ot_desc *y = &plan->outputs[0];
  y->present = 1;
  y->type = op->outputs[0].type;
  y->rank = 3;
  y->dims[0] = batch;
  y->dims[1] = s;
  y->dims[2] = nq * head_dim;
  return 0;
}

int ot_causal_attention_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                               const double *attrs, void *storage, void **params) {
  /* Y, then the workspace (NULL in one pass, where the kernel never touches it) */
  void *const pointers[6] = {ptrs[IN_Q], ptrs[IN_K], ptrs[IN_V], ptrs[IN_KEY_BIAS], ptrs[op->n_inputs], plan->scratch};
  void *const counters = plan->counters; /* CNT: the merge counters of PHASE 3, else NULL (never touched) */
  const int sm = attrs[ATTR_SEQ_MAJOR] == 1;
  const int32_t batch = (int32_t)in[IN_Q].dims[0]; /* the plan checked these fit int32 */
  const int32_t nq = (int32_t)in[IN_Q].dims[1];
  const int32_t nkv = (int32_t)in[IN_K].dims[sm ? 2 : 1];
  const int32_t s = (int32_t)in[IN_Q].dims[2];
  const int32_t t = (int32_t)in[IN_K].dims[sm ? 0 : 2];
  const float scale = (float)attrs[ATTR_SCALE];
  const int32_t mean_rows = (int32_t)attrs[ATTR_MASKED_ROWS];
  const int64_t chunk = plan->values[VALUE_SPLIT];
  /* keys per chunk (>= 1 in every phase: the kernel divides by it); PHASE 0 one pass, 1 chunks, 2 merge, 3 both */
  const int32_t split = chunk ? (int32_t)chunk : (int32_t)plan->spec->consts[CONST_BLOCK_N];
  const int32_t phase = !chunk ? 0 : counters ? 3 : 1 + plan->launch;

  uint64_t *slot = storage;
  int n = 0;
  for (int i = 0; i < 6; i++) ot_put_param(slot, params, n++, &pointers[i], sizeof pointers[i]);
  ot_put_param(slot, params, n++, &nq, sizeof nq);
  ot_put_param(slot, params, n++, &nkv, sizeof nkv);
  ot_put_param(slot, params, n++, &s, sizeof s);
  ot_put_param(slot, params, n++, &t, sizeof t);
  ot_put_param(slot, params, n++, &scale, sizeof scale);
  ot_put_param(slot, params, n++, &mean_rows, sizeof mean_rows);
  ot_put_param(slot, params, n++, &split, sizeof split);
  ot_put_param(slot, params, n++, &phase, sizeof phase);
  ot_put_param(slot, params, n++, &counters, sizeof counters);
  ot_put_param(slot, params, n++, &batch, sizeof batch);
  return n;
}
