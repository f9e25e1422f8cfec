/* attention.c: planners and kernel parameters for MultiHeadAttention and PackedMultiHeadAttention (contracts:
 * ort_triton/ops/attention.py, ort_triton/ops/packed_attention.py; one kernel: ort_triton/kernels/attention.py).
 *
 * MultiHeadAttention inputs: Q [B, Sq, N*D], K and V [B, Skv, N*D], key_bias [B, Skv], k_bias, v_bias [N*D]
 * PackedMultiHeadAttention inputs: QKV [B, S, 3*N*D], key_bias [B, S], bias [3*N*D]; the kernel gets
 *   Q, K, V as pointers 0, N*D and 2*N*D elements into QKV (its PACKED specs stride rows by 3*N*D), the Q
 *   bias at bias and V's 2*N*D elements on.
 * Output:  Y [B, Sq, N*D]. The kernel reads v_bias (and the packed Q bias); k_bias cancels in the softmax.
 * Attributes (contract order, both ops): num_heads (N), scale.
 * Dispatch keys: the head dim D (exact), whether Sq and Skv are multiples of 16, Sq and B * N (the built-in
 * specs take any; a tuning table's narrow them to buckets). Spec consts = (BLOCK_M, BLOCK_N, HEAD_DIM).
 * Grid: one flat axis of ceil(Sq / BLOCK_M) * B * N programs, the query block fastest (the kernel splits the
 * program id the same way); grid.x allows 2^31 - 1 where grid.y would stop at 65535 (B * N passes that
 * for a batch of 8192 with 8 heads).
 * The generic code (ort_triton.c) has already checked presence of inputs and element types. */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "ot_table.h"
#include "planner_util.h"

enum { IN_Q, IN_K, IN_V, IN_KEY_BIAS, IN_K_BIAS, IN_V_BIAS, N_INPUTS };
enum { IN_QKV, IN_PACKED_KEY_BIAS, IN_BIAS, N_PACKED_INPUTS };
enum { ATTR_NUM_HEADS, ATTR_SCALE };
enum { KEY_HEAD_DIM, KEY_SEQ_DIV16, KEY_SQ, KEY_BATCH_HEADS, N_KEYS }; /* dispatch keys, in contract order */
enum { CONST_BLOCK_M, CONST_BLOCK_N, CONST_HEAD_DIM }; /* meaning of ot_spec.consts */
#define LAYOUT "[B, S, num_heads * head_dim]" /* Q, K, V and packed QKV (3 heads' worth) */

/* Q, K, V: [B, S, hidden], no negative dims (ORT never passes those; the test hook can). */
/* The rest of both plans, once the shapes are known consistent: heads, spec, grid, output [B, Sq, hidden].
 * x_name names the input whose dim 2 holds the hidden size (Q, or QKV with 3 of it), k_name Skv's. */
static int plan_heads(const ot_op *op, const ot_desc *x, int64_t batch, int64_t sq, int64_t skv, int64_t hidden,
                      const double *attrs, const char *x_name, const char *k_name, ot_plan *plan, char *err,
                      size_t err_len);

static int check_table(const ot_op *op, int n_inputs, int n_outputs, int want_inputs, char *err, size_t err_len) {
  if (n_inputs != want_inputs || n_outputs != 1 || op->n_attrs != 2) {
    snprintf(err, err_len, "the kernel table gives this op %d inputs, %d outputs and %d attributes, the attention "
                           "planner expects %d, 1 and 2; the library is inconsistent, rebuild it",
             n_inputs, n_outputs, op->n_attrs, want_inputs);
    return 1;
  }
  return 0;
}

int ot_attention_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                          ot_plan *plan, char *err, size_t err_len) {
  if (check_table(op, n_inputs, n_outputs, N_INPUTS, err, err_len)) return 1;
  for (int i = IN_Q; i <= IN_V; i++)
    if (ot_check_rank(op, in, i, 3, LAYOUT, err, err_len)) return 1;
  const ot_desc *q = &in[IN_Q], *k = &in[IN_K], *v = &in[IN_V], *kb = &in[IN_KEY_BIAS];
  const char *q_name = op->inputs[IN_Q].name, *k_name = op->inputs[IN_K].name;
  char a[160], b[160];
  if (memcmp(v->dims, k->dims, 3 * sizeof k->dims[0]) != 0) {
    snprintf(err, err_len, "input %s has shape %s but input %s has shape %s; they must be equal",
             op->inputs[IN_V].name, ot_shape_text(v, a, sizeof a), k_name, ot_shape_text(k, b, sizeof b));
    return 1;
  }
  const int64_t batch = q->dims[0], sq = q->dims[1], hidden = q->dims[2], skv = k->dims[1];
  if (k->dims[0] != batch || k->dims[2] != hidden) {
    snprintf(err, err_len, "input %s has shape %s but input %s has shape %s; they must agree in batch (dim 0) "
                           "and hidden size (dim 2)",
             k_name, ot_shape_text(k, a, sizeof a), q_name, ot_shape_text(q, b, sizeof b));
    return 1;
  }
  if (kb->rank != 2 || kb->dims[0] != batch || kb->dims[1] != skv) {
    snprintf(err, err_len, "input %s has shape %s; it must be [%lld,%lld], [B, Skv] of inputs %s and %s",
             op->inputs[IN_KEY_BIAS].name, ot_shape_text(kb, a, sizeof a), (long long)batch, (long long)skv,
             q_name, k_name);
    return 1;
  }

  for (int i = IN_K_BIAS; i <= IN_V_BIAS; i++)
    if (ot_check_vector(op, in, i, hidden, err, err_len)) return 1;
  return plan_heads(op, q, batch, sq, skv, hidden, attrs, q_name, k_name, plan, err, err_len);
}

int ot_packed_attention_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                             ot_plan *plan, char *err, size_t err_len) {
  if (check_table(op, n_inputs, n_outputs, N_PACKED_INPUTS, err, err_len)) return 1;
  if (ot_check_rank(op, in, IN_QKV, 3, LAYOUT, err, err_len)) return 1;
  const ot_desc *qkv = &in[IN_QKV], *kb = &in[IN_PACKED_KEY_BIAS];
  const char *name = op->inputs[IN_QKV].name;
  char a[160], b[160];
  const int64_t batch = qkv->dims[0], seq = qkv->dims[1], width = qkv->dims[2];
  if (width % 3 != 0) {
    snprintf(err, err_len, "input %s has shape %s; its dim 2 must be 3 x the hidden size (Q, K, V side by side)",
             name, ot_shape_text(qkv, a, sizeof a));
    return 1;
  }
  if (kb->rank != 2 || kb->dims[0] != batch || kb->dims[1] != seq) {
    snprintf(err, err_len, "input %s has shape %s; it must be [%lld,%lld], [B, S] of input %s (shape %s)",
             op->inputs[IN_PACKED_KEY_BIAS].name, ot_shape_text(kb, a, sizeof a), (long long)batch,
             (long long)seq, name, ot_shape_text(qkv, b, sizeof b));
    return 1;
  }
  if (ot_check_vector(op, in, IN_BIAS, width, err, err_len)) return 1;
  return plan_heads(op, qkv, batch, seq, seq, width / 3, attrs, name, name, plan, err, err_len);
}

static int plan_heads(const ot_op *op, const ot_desc *x, int64_t batch, int64_t sq, int64_t skv, int64_t hidden,
                      const double *attrs, const char *x_name, const char *k_name, ot_plan *plan, char *err,
                      size_t err_len) {
  /* attrs hold an ONNX int64 as a double: integral, and the kernel takes it as int32 */
  const double heads_attr = attrs[ATTR_NUM_HEADS];
  if (!(heads_attr >= 1 && heads_attr <= INT32_MAX) || heads_attr != (double)(int64_t)heads_attr) {
    snprintf(err, err_len, "attribute num_heads=%g must be an integer in 1..%d", heads_attr, INT32_MAX);
    return 1;
  }
  const int64_t heads = (int64_t)heads_attr;
  if (hidden % heads != 0) {
    snprintf(err, err_len, "hidden size %lld (%sdim 2 of input %s) is not a multiple of num_heads=%lld",
             (long long)hidden, x->dims[2] == hidden ? "" : "a third of ", x_name, (long long)heads);
    return 1;
  }
  const int64_t head_dim = hidden / heads;
  /* Sq and Skv multiples of 16 take the spec that knows it: the key-bias row of a batch starts 16-byte
   * aligned there, so its loads pipeline with K and V's (ops/attention.py) */
  const int64_t keys[N_KEYS] = {head_dim, sq % 16 == 0 && skv % 16 == 0, sq, batch * heads};
  const ot_spec *spec = ot_find_spec(op, keys, N_KEYS, plan->arch);
  if (!spec) {
    char dims[256];
    ot_key_values(op, N_KEYS, KEY_HEAD_DIM, dims, sizeof dims);
    if (!dims[0])
      snprintf(err, err_len, "this library holds no kernels for this op; rebuild it with the op included");
    else
      snprintf(err, err_len, "head dim %lld (hidden size %lld / num_heads %lld) is not supported; this library "
                             "has kernels for head dims %s (the rewriter should not have fused this node)",
               (long long)head_dim, (long long)hidden, (long long)heads, dims);
    return 1;
  }
  const int64_t block_m = spec->consts[CONST_BLOCK_M], block_n = spec->consts[CONST_BLOCK_N];
  if (block_m < 1 || block_n < 1 || spec->consts[CONST_HEAD_DIM] != head_dim) {
    snprintf(err, err_len, "kernel %s has BLOCK_M=%lld, BLOCK_N=%lld, HEAD_DIM=%lld in the kernel table for head "
                           "dim %lld; rebuild the library",
             spec->kernel_name, (long long)block_m, (long long)block_n, (long long)spec->consts[CONST_HEAD_DIM],
             (long long)head_dim);
    return 1;
  }
  /* The kernel indexes query rows and keys in int32, a block past the end included. */
  const int64_t max_seq = INT32_MAX - (block_m > block_n ? block_m : block_n);
  if (sq > max_seq || skv > max_seq) {
    snprintf(err, err_len, "sequence length %lld (dim 1 of input %s) is more than this kernel's %lld",
             (long long)(sq > max_seq ? sq : skv), sq > max_seq ? x_name : k_name, (long long)max_seq);
    return 1;
  }
  int64_t programs; /* ceil(Sq / BLOCK_M) * B * N */
  if (ot_grid_programs(sq, block_m, batch, heads, "Sq", "num_heads", &programs, err, err_len)) return 1;

  plan->spec = spec;
  plan->grid[0] = (unsigned)programs; /* 0 for an empty batch or Sq = 0: the caller skips the launch */
  plan->grid[1] = 1;
  plan->grid[2] = 1;
  plan->outputs[0] = *x;
  plan->outputs[0].dims[2] = hidden;
  plan->outputs[0].type = op->outputs[0].type;
  return 0;
}


/* The kernel's parameters (Q, K, V, KB, BQ, BV, Y, N, SQ, SKV, scale); the spec's constants are compiled in. */
static int put_params(void *const pointers[7], const double *attrs, int64_t sq_dim, int64_t skv_dim, void *storage,
                      void **params) {
  const int32_t heads = (int32_t)attrs[ATTR_NUM_HEADS]; /* the plan checked these fit int32 */
  const int32_t sq = (int32_t)sq_dim, skv = (int32_t)skv_dim;
  const float scale = (float)attrs[ATTR_SCALE];

  uint64_t *slot = storage;
  int n = 0;
  for (int i = 0; i < 7; i++) ot_put_param(slot, params, n++, &pointers[i], sizeof pointers[i]);
  ot_put_param(slot, params, n++, &heads, sizeof heads);
  ot_put_param(slot, params, n++, &sq, sizeof sq);
  ot_put_param(slot, params, n++, &skv, sizeof skv);
  ot_put_param(slot, params, n++, &scale, sizeof scale);
  return n;
}

int ot_attention_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                        const double *attrs, void *storage, void **params) {
  (void)plan;
  /* BQ: the unpacked specs never read it (Q's bias is a graph Add there); v_bias is a valid pointer */
  void *const pointers[7] = {ptrs[IN_Q], ptrs[IN_K], ptrs[IN_V], ptrs[IN_KEY_BIAS], ptrs[IN_V_BIAS],
                             ptrs[IN_V_BIAS], ptrs[op->n_inputs]}; /* Y */
  return put_params(pointers, attrs, in[IN_Q].dims[1], in[IN_K].dims[1], storage, params);
}

int ot_packed_attention_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                               const double *attrs, void *storage, void **params) {
  (void)plan;
  const int64_t hidden = in[IN_QKV].dims[2] / 3;
  const int64_t step = hidden * (int64_t)ot_element_size(in[IN_QKV].type); /* K's offset into a row, bytes */
  char *qkv = ptrs[IN_QKV], *bias = ptrs[IN_BIAS];
  void *const pointers[7] = {qkv, qkv + step, qkv + 2 * step, ptrs[IN_PACKED_KEY_BIAS], bias, bias + 2 * step,
                             ptrs[op->n_inputs]}; /* Y */
  return put_params(pointers, attrs, in[IN_QKV].dims[1], in[IN_QKV].dims[1], storage, params);
}
