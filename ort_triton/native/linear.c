/* linear.c: planner and kernel parameters for Linear (contract: ort_triton/ops/linear.py; kernel:
 * ort_triton/kernels/gemv.py), Y = X @ WT^T.
 * Inputs: X [..., K], WT [N, K] (the weight transposed). Output: Y [..., N].
 * Up to 16 rows (a decode step) and a spec whose key ranges fit: the Triton kernel (the register GEMV or the skinny
 * tl.dot product, as the spec says), grid (ceil(N / BLOCK_N)); spec consts = (BLOCK_N, BLOCK_K, the most rows the
 * kernel computes: 1 for the GEMV, 16 for the skinny product).
 * More rows, or a shape no spec serves: cuBLAS on ORT's handle, Y^T = WT X^T in column-major terms. */
#include <stdio.h>

#include "ot_table.h"
#include "planner_util.h"

enum { IN_X, IN_WT, N_INPUTS };
enum { KEY_ROWS, KEY_K_ALIGN, KEY_K, KEY_N, N_KEYS }; /* dispatch keys, in contract order */
enum { CONST_BLOCK_N, CONST_BLOCK_K, CONST_MAX_ROWS }; /* meaning of ot_spec.consts */

int ot_linear_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                   ot_plan *plan, char *err, size_t err_len) {
  (void)attrs;
  if (n_inputs != N_INPUTS || n_outputs != 1) {
    snprintf(err, err_len, "the kernel table gives this op %d inputs and %d outputs, the linear planner expects "
                           "2 and 1; the library is inconsistent, rebuild it", n_inputs, n_outputs);
    return 1;
  }
  const ot_desc *x = &in[IN_X], *wt = &in[IN_WT];
  if (ot_check_rows_by_h(x, op->inputs[IN_X].name, err, err_len)) return 1;
  if (ot_check_rank(op, in, IN_WT, 2, "[N, K]", err, err_len)) return 1;
  const int64_t k = x->dims[x->rank - 1], n = wt->dims[0];
  if (wt->dims[1] != k) {
    char a[160], b[160];
    snprintf(err, err_len, "input %s has shape %s and input %s has shape %s; %s must be [N, K] with K = %lld, "
             "the last dimension of %s", op->inputs[IN_WT].name, ot_shape_text(wt, a, sizeof a),
             op->inputs[IN_X].name, ot_shape_text(x, b, sizeof b), op->inputs[IN_WT].name, (long long)k,
             op->inputs[IN_X].name);
    return 1;
  }
  if (n > INT32_MAX) {
    snprintf(err, err_len, "input %s has N=%lld rows; Linear takes up to %d output columns", op->inputs[IN_WT].name,
             (long long)n, INT32_MAX);
    return 1;
  }
  const int64_t rows = ot_row_count(x); /* fits int32: checked with x */
  plan->outputs[0] = *x;
  plan->outputs[0].dims[x->rank - 1] = n;
  plan->grid[0] = plan->grid[1] = plan->grid[2] = 1;
  if (rows == 0 || n == 0) { /* an empty output: nothing to compute */
    plan->grid[0] = 0;
    return 0;
  }
  /* the specs' ROWS ranges end at 16 (the skinny product's BLOCK_M): more rows find none; the MAX_ROWS const holds
   * a spec to what its kernel computes even where a tuning table's ROWS range says more */
  const int64_t keys[N_KEYS] = {rows, ot_k_align(k), k, n};
  const ot_spec *spec = ot_find_spec(op, keys, N_KEYS, plan->arch);
  if (spec && spec->consts[CONST_BLOCK_N] >= 1 && spec->consts[CONST_BLOCK_K] >= 1 &&
      rows <= spec->consts[CONST_MAX_ROWS]) {
    const int64_t block = spec->consts[CONST_BLOCK_N];
    plan->spec = spec;
    plan->grid[0] = (unsigned)((n + block - 1) / block);
    return 0;
  }
  /* Column-major: C = Y^T [N, rows] (ld N) = op(A) B, A = WT seen as [K, N] (ld K) transposed, B = X^T [K, rows]
   * (ld K). The TN form, cuBLAS's fastest for a weight stored so. */
  plan->gemms[0] = (ot_gemm){.m = n, .n = rows, .k = k, .lda = k, .ldb = k, .ldc = n, .trans_a = 1, .trans_b = 0,
                         .a = IN_WT, .b = IN_X, .c = N_INPUTS};
  return 0;
}

int ot_linear_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs, const double *attrs,
                     void *storage, void **params) {
  (void)op, (void)plan, (void)attrs;
  /* the plan checked they fit: N and K, and the rows with X */
  const int32_t m = (int32_t)ot_row_count(&in[IN_X]), n = (int32_t)in[IN_WT].dims[0], k = (int32_t)in[IN_WT].dims[1];
  uint64_t *slot = storage;
  int i = 0;
  for (int p = 0; p < 3; p++) ot_put_param(slot, params, i++, &ptrs[p], sizeof ptrs[p]); /* X, WT, Y */
  ot_put_param(slot, params, i++, &m, sizeof m);
  ot_put_param(slot, params, i++, &n, sizeof n);
  ot_put_param(slot, params, i++, &k, sizeof k);
  return i;
}
