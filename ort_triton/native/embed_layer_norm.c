/* embed_layer_norm.c: planner and kernel parameters for EmbedLayerNorm (contract:
 * ort_triton/ops/embed_layer_norm.py; kernel: ort_triton/kernels/embed_layer_norm.py).
 *
 * Inputs:  input_ids, token_type_ids, position_ids: int64 [B', S'] each, B' in {1, B}, S' in {1, S}, where
 *          [B, S] is their broadcast; word_embeddings, token_type_embeddings, position_embeddings [V, H];
 *          gamma, beta [H].
 * Output:  Y [B, S, H] = LayerNorm((word[ids0] + type[ids1]) + pos[ids2]), a NaN row for an id outside its table.
 * Dispatch keys: (H % 16 == 0, H); consts = (BLOCK_H, ROWS). Grid: ceil(B * S / ROWS).
 * The generic code (ort_triton.c) has already checked presence and element types (ids int64, the rest the
 * op's type). */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "ot_table.h"
#include "planner_util.h"

enum { IN_IDS0, IN_IDS1, IN_IDS2, IN_TABLE0, IN_TABLE1, IN_TABLE2, IN_GAMMA, IN_BETA, N_INPUTS };
enum { KEY_H_DIV16, KEY_H, N_KEYS };
enum { CONST_BLOCK_H, CONST_ROWS_PER_PROGRAM };

/* The broadcast [B, S] of the three id tensors and H, which the params step reads back. */
typedef struct {
  int64_t batch, seq, h;
} embed_shape;

/* a and b broadcast (one of them 1, or equal) into *out. */
static int broadcast(int64_t a, int64_t b, int64_t *out) {
  if (a != 1 && b != 1 && a != b) return 1;
  *out = a == 1 ? b : a;
  return 0;
}

static int shape_of(const ot_op *op, const ot_desc *in, embed_shape *out, char *err, size_t err_len) {
  char a[160], b[160], c[160];
  const ot_desc *gamma = &in[IN_GAMMA];
  if (gamma->rank != 1 || gamma->dims[0] < 1 || gamma->dims[0] > INT32_MAX) {
    snprintf(err, err_len, "input %s has shape %s; it must be [H] with H in 1..%d", op->inputs[IN_GAMMA].name,
             ot_shape_text(gamma, a, sizeof a), INT32_MAX);
    return 1;
  }
  out->h = gamma->dims[0];
  out->batch = out->seq = 1;
  for (int i = IN_IDS0; i <= IN_IDS2; i++) {
    const ot_desc *ids = &in[i];
    if (ids->rank != 2 || ids->dims[0] < 0 || ids->dims[1] < 0) {
      snprintf(err, err_len, "input %s has shape %s; it must be [B or 1, S or 1] (rank 2)", op->inputs[i].name,
               ot_shape_text(ids, a, sizeof a));
      return 1;
    }
  }
  for (int i = IN_IDS0; i <= IN_IDS2; i++) {
    if (broadcast(out->batch, in[i].dims[0], &out->batch) || broadcast(out->seq, in[i].dims[1], &out->seq)) {
      snprintf(err, err_len, "input %s has shape %s, input %s %s and input %s %s; each must be [1 or B, 1 or S] "
                             "of one [B, S] (ids broadcast, as the function body's Adds)",
               op->inputs[IN_IDS0].name, ot_shape_text(&in[IN_IDS0], a, sizeof a), op->inputs[IN_IDS1].name,
               ot_shape_text(&in[IN_IDS1], b, sizeof b), op->inputs[IN_IDS2].name,
               ot_shape_text(&in[IN_IDS2], c, sizeof c));
      return 1;
    }
  }
  if (out->batch > 0 && out->seq > INT32_MAX / out->batch) { /* the kernel's token index is int32 */
    snprintf(err, err_len, "the ids are [B, S] = [%lld, %lld]: more than %d tokens; split the batch",
             (long long)out->batch, (long long)out->seq, INT32_MAX);
    return 1;
  }
  for (int i = IN_TABLE0; i <= IN_TABLE2; i++) {
    const ot_desc *t = &in[i];
    if (t->rank != 2 || t->dims[1] != out->h || t->dims[0] < 0 || t->dims[0] > INT32_MAX) {
      snprintf(err, err_len, "input %s has shape %s; it must be [V, H] with H = %lld, the size of input %s, and V "
                             "up to %d", op->inputs[i].name, ot_shape_text(t, a, sizeof a), (long long)out->h,
               op->inputs[IN_GAMMA].name, INT32_MAX);
      return 1;
    }
  }
  /* beta must be [H], H read from gamma (ot_check_vector names input 0 as H's source, here the ids) */
  if (in[IN_BETA].rank != 1 || in[IN_BETA].dims[0] != out->h) {
    snprintf(err, err_len, "input %s has shape %s; it must be [%lld], the shape of input %s", op->inputs[IN_BETA].name,
             ot_shape_text(&in[IN_BETA], a, sizeof a), (long long)out->h, op->inputs[IN_GAMMA].name);
    return 1;
  }
  return 0;
}

int ot_embed_layer_norm_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                             ot_plan *plan, char *err, size_t err_len) {
  (void)attrs;
  if (n_inputs != N_INPUTS || n_outputs != 1) {
    snprintf(err, err_len, "the kernel table gives this op %d inputs and %d outputs, the embed_layer_norm planner "
                           "expects %d and 1; the library is inconsistent, rebuild it",
             n_inputs, n_outputs, N_INPUTS);
    return 1;
  }
  embed_shape sh;
  if (shape_of(op, in, &sh, err, err_len)) return 1;
  const int64_t keys[N_KEYS] = {sh.h % 16 == 0, sh.h};
  const ot_spec *spec = ot_find_spec(op, keys, N_KEYS, plan->arch);
  if (!spec) {
    snprintf(err, err_len, "hidden size H=%lld (the size of input %s) is not supported; this library's kernels "
                           "take H up to %lld", (long long)sh.h, op->inputs[IN_GAMMA].name,
             op->n_specs ? (long long)op->specs[op->n_specs - 1].key_max[KEY_H] : 0LL);
    return 1;
  }
  const int64_t rows = spec->consts[CONST_ROWS_PER_PROGRAM];
  if (rows < 1 || spec->consts[CONST_BLOCK_H] < sh.h) {
    snprintf(err, err_len, "kernel %s has BLOCK_H=%lld, ROWS=%lld in the kernel table for H=%lld; rebuild the "
                           "library", spec->kernel_name, (long long)spec->consts[CONST_BLOCK_H], (long long)rows,
             (long long)sh.h);
    return 1;
  }
  plan->spec = spec;
  plan->grid[0] = (unsigned)((sh.batch * sh.seq + rows - 1) / rows);
  plan->grid[1] = plan->grid[2] = 1;
  plan->outputs[0] = (ot_desc){.present = 1, .type = op->outputs[0].type, .rank = 3,
                               .dims = {sh.batch, sh.seq, sh.h}};
  return 0;
}

int ot_embed_layer_norm_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                               const double *attrs, void *storage, void **params) {
  (void)plan; /* BLOCK_H and ROWS are compiled into the kernel; only shapes are passed */
  embed_shape sh;
  char err[8];
  if (shape_of(op, in, &sh, err, sizeof err)) return -1; /* the plan has checked them */
  /* n_rows, S, then (batch stride, sequence stride) of each id tensor: 0 along a broadcast 1 */
  int32_t v[8] = {(int32_t)(sh.batch * sh.seq), (int32_t)sh.seq};
  for (int i = IN_IDS0; i <= IN_IDS2; i++) {
    v[2 + 2 * i] = in[i].dims[0] != 1 ? (int32_t)in[i].dims[1] : 0;
    v[3 + 2 * i] = in[i].dims[1] != 1 ? 1 : 0;
  }
  const int32_t vocab[3] = {(int32_t)in[IN_TABLE0].dims[0], (int32_t)in[IN_TABLE1].dims[0],
                            (int32_t)in[IN_TABLE2].dims[0]};
  const int32_t h = (int32_t)sh.h;
  const float eps = (float)attrs[0];

  uint64_t *slot = storage;
  int n = 0;
  /* I0, I1, I2, T0, T1, T2, W (gamma), B (beta), then Y */
  for (int i = 0; i < N_INPUTS + 1; i++) ot_put_param(slot, params, n++, &ptrs[i], sizeof ptrs[i]);
  for (int i = 0; i < 8; i++) ot_put_param(slot, params, n++, &v[i], sizeof v[i]);
  for (int i = 0; i < 3; i++) ot_put_param(slot, params, n++, &vocab[i], sizeof vocab[i]);
  ot_put_param(slot, params, n++, &h, sizeof h);
  ot_put_param(slot, params, n++, &eps, sizeof eps);
  return n;
}
