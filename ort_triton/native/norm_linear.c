/* norm_linear.c: planner and kernel parameters for AddRMSNormLinear and AddRMSNormSwiGLU (contracts:
 * ort_triton/ops/norm_linear.py; kernel: ort_triton/kernels/norm_linear.py).
 * Inputs: X [..., K], skip (X's shape), gamma [K], WT [N, K] (SwiGLU: WGT, WUT [N, K]). Outputs: Y [..., N], sum.
 * Up to BLOCK_M rows and a fused spec for (K, N): one launch, MODE 0, grid ceil(N / BLOCK_N).
 * Otherwise the steps: launch 0 (MODE 1, a program a row) normalises the rows into workspace region WS_N and writes
 * sum; cuBLAS multiplies them by the weight (TN, as Linear) into Y, or for SwiGLU by each weight into WS_G and WS_U;
 * launch 1 (MODE 2, SwiGLU only) writes Y = silu(G) * U, [rows, N] as one flat array in blocks of BLOCK_M x BLOCK_N
 * elements. spec consts = (rows: the fused spec's most, the steps' BLOCK_M; BLOCK_N, BLOCK_K). */
#include <limits.h>
#include <stdio.h>

#include "ot_table.h"
#include "planner_util.h"

enum { IN_X, IN_SKIP, IN_GAMMA, IN_WT, IN_WT2 };
enum { OUT_Y, OUT_SUM };
enum { KEY_FUSED, KEY_K_ALIGN, KEY_K, KEY_N, N_KEYS }; /* dispatch keys, in contract order */
enum { CONST_ROWS, CONST_BLOCK_N, CONST_BLOCK_K };    /* meaning of ot_spec.consts */
enum { WS_N, WS_G, WS_U };                             /* workspace regions of the steps */
enum { VALUE_MODE0 };                                  /* plan->values: MODE of launch 0 (launch 1 is MODE 2) */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Input `index` must be [N, K] with the given K; n_out gets N (the first weight's, which the second must match). */
static int check_weight(const ot_op *op, const ot_desc *in, int index, int64_t k, int64_t *n_out, char *err,
                        size_t err_len) {
  if (ot_check_rank(op, in, index, 2, "[N, K]", err, err_len)) return 1;
  const ot_desc *w = &in[index];
  if (w->dims[1] != k || (index == IN_WT2 && w->dims[0] != *n_out)) {
    char a[160], b[160];
    snprintf(err, err_len, "input %s has shape %s; it must be [N, K] with K = %lld, the last dimension of %s %s%s",
             op->inputs[index].name, ot_shape_text(w, a, sizeof a), (long long)k, op->inputs[IN_X].name,
             ot_shape_text(&in[IN_X], b, sizeof b), index == IN_WT2 ? ", and the shape of the first weight" : "");
    return 1;
  }
  if (w->dims[0] > INT32_MAX) {
    snprintf(err, err_len, "input %s has N=%lld rows; this op takes up to %d output columns", op->inputs[index].name,
             (long long)w->dims[0], INT32_MAX);
    return 1;
  }
  *n_out = w->dims[0];
  return 0;
}

int ot_norm_linear_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                        ot_plan *plan, char *err, size_t err_len) {
  (void)attrs, (void)n_outputs; /* an absent sum output is a NULL pointer to the params: no plan of its own */
  const int swiglu = n_inputs == 5;
  if ((n_inputs != 4 && n_inputs != 5) || op->n_outputs != 2) {
    snprintf(err, err_len, "the kernel table gives this op %d inputs and %d outputs, the norm_linear planner "
                           "expects 4 or 5 and 2; the library is inconsistent, rebuild it", n_inputs, op->n_outputs);
    return 1;
  }
  const ot_desc *x = &in[IN_X];
  if (ot_check_rows_by_h(x, op->inputs[IN_X].name, err, err_len)) return 1;
  if (ot_check_same_shape(op, in, IN_SKIP, IN_X, err, err_len)) return 1;
  const int64_t k = x->dims[x->rank - 1];
  if (ot_check_vector(op, in, IN_GAMMA, k, err, err_len)) return 1;
  int64_t n = 0;
  if (check_weight(op, in, IN_WT, k, &n, err, err_len)) return 1;
  if (swiglu && check_weight(op, in, IN_WT2, k, &n, err, err_len)) return 1;

  const int64_t rows = ot_row_count(x); /* 0..INT32_MAX: checked with x */
  plan->outputs[OUT_Y] = *x;
  plan->outputs[OUT_Y].dims[x->rank - 1] = n;
  plan->outputs[OUT_SUM] = *x;
  plan->grid[0] = plan->grid[1] = plan->grid[2] = 1;
  if (rows == 0) { /* empty outputs: nothing to compute */
    plan->grid[0] = 0;
    return 0;
  }

  const int64_t fused_keys[N_KEYS] = {1, ot_k_align(k), k, n};
  const ot_spec *spec = ot_find_spec(op, fused_keys, N_KEYS, plan->arch);
  if (spec && n > 0 && rows <= spec->consts[CONST_ROWS] && spec->consts[CONST_BLOCK_N] >= 1) {
    plan->spec = spec;
    plan->grid[0] = (unsigned)ceil_div(n, spec->consts[CONST_BLOCK_N]);
    plan->values[VALUE_MODE0] = 0;
    return 0;
  }

  const int64_t steps_keys[N_KEYS] = {0, ot_k_align(k), k, n};
  spec = ot_find_spec(op, steps_keys, N_KEYS, plan->arch);
  if (!spec || spec->consts[CONST_ROWS] < 1 || spec->consts[CONST_BLOCK_N] < 1) {
    snprintf(err, err_len, "this library holds no kernel for this op's steps beyond %s rows; rebuild it with the "
                           "op included", spec ? "its fused" : "the fused kernel's");
    return 1;
  }
  const size_t elem = ot_element_size(x->type);
  const int64_t tiles = swiglu ? ceil_div(rows * n, spec->consts[CONST_ROWS] * spec->consts[CONST_BLOCK_N]) : 0;
  if (rows > INT32_MAX || tiles > INT32_MAX ||
      (uint64_t)rows * (uint64_t)(k + (swiglu ? 2 * n : 0)) > SIZE_MAX / 2 / elem) {
    snprintf(err, err_len, "%lld rows x N=%lld need more programs or workspace than one launch takes",
             (long long)rows, (long long)n);
    return 1;
  }
  plan->spec = spec;
  plan->values[VALUE_MODE0] = 1;
  plan->grid[0] = (unsigned)rows; /* MODE 1: a row a program */
  /* regions WS_N [rows, K], WS_G and WS_U [rows, N], each starting 256-byte aligned */
  const size_t normed = ((size_t)rows * (size_t)k * elem + 255) / 256 * 256;
  const size_t product = ((size_t)rows * (size_t)n * elem + 255) / 256 * 256;
  plan->ws_offsets[WS_N] = 0;
  plan->ws_offsets[WS_G] = normed;
  plan->ws_offsets[WS_U] = normed + product;
  plan->scratch_bytes = normed + (swiglu ? 2 * product : 0);
  if (n == 0) return 0; /* the norm alone: it writes sum, Y is empty */
  /* Column-major: C = Y^T [N, rows] (ld N) = WT^T-as-[K, N] transposed times normed^T [K, rows] (ld K) */
  const ot_gemm g = {.m = n, .n = rows, .k = k, .lda = k, .ldb = k, .ldc = n, .trans_a = 1, .trans_b = 0,
                     .a = IN_WT, .b = OT_PTR_WS + WS_N, .c = swiglu ? OT_PTR_WS + WS_G : n_inputs + OUT_Y};
  plan->gemms[0] = g;
  if (swiglu) {
    plan->gemms[1] = g;
    plan->gemms[1].a = IN_WT2;
    plan->gemms[1].c = OT_PTR_WS + WS_U;
    plan->n_launches = 2;
    plan->grid2[0] = (unsigned)tiles;
    plan->grid2[1] = plan->grid2[2] = 1;
  }
  return 0;
}

int ot_norm_linear_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                          const double *attrs, void *storage, void **params) {
  const int n_in = op->n_inputs, swiglu = n_in == 5;
  void *const y = ptrs[n_in + OUT_Y], *const sum = ptrs[n_in + OUT_SUM];
  void *const ws_n = plan->scratch ? ptrs[OT_PTR_WS + WS_N] : NULL;
  void *const pointers[10] = {
      ptrs[IN_X], ptrs[IN_SKIP], ptrs[IN_GAMMA], ptrs[IN_WT],
      swiglu ? ptrs[IN_WT2] : ptrs[IN_WT], /* WT2: read only with SwiGLU */
      y, sum ? sum : y,                    /* S: written only when store_sum */
      ws_n, plan->scratch ? ptrs[OT_PTR_WS + WS_G] : NULL, plan->scratch ? ptrs[OT_PTR_WS + WS_U] : NULL,
  };
  const int32_t m = (int32_t)ot_row_count(&in[IN_X]); /* the plan checked it fits */
  const int32_t n = (int32_t)in[IN_WT].dims[0], k = (int32_t)in[IN_WT].dims[1];
  const float eps = (float)attrs[0];
  /* launch 1 (MODE 2) writes only Y; the sum was written by launch 0 */
  const int32_t store_sum = sum != NULL && plan->launch == 0;
  const int32_t mode = plan->launch ? 2 : (int32_t)plan->values[VALUE_MODE0];
  uint64_t *slot = storage;
  int i = 0;
  for (int p = 0; p < 10; p++) ot_put_param(slot, params, i++, &pointers[p], sizeof pointers[p]);
  ot_put_param(slot, params, i++, &m, sizeof m);
  ot_put_param(slot, params, i++, &n, sizeof n);
  ot_put_param(slot, params, i++, &k, sizeof k);
  ot_put_param(slot, params, i++, &eps, sizeof eps);
  ot_put_param(slot, params, i++, &store_sum, sizeof store_sum);
  ot_put_param(slot, params, i++, &mode, sizeof mode);
  return i;
}
