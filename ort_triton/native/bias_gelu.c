/* bias_gelu.c: planner and kernel parameters for BiasGelu and BiasGeluTanh (one Triton kernel,
 * Y = gelu(X + bias) elementwise over [rows, H]; the tanh form is the spec's TANH constexpr), and for BiasGeluMul
 * and BiasGeluTanhMul (Y = gelu(X + bias) * up, the same kernel body with the product).
 * Inputs: X [..., H], bias [H] (Mul ops: then up, X's shape). Output: Y, X's shape. */
#include <stdio.h>

#include "ot_table.h"
#include "planner_util.h"

enum { KEY_H_DIV16, N_KEYS };                 /* dispatch keys, in contract order */
enum { CONST_ROWS, CONST_BLOCK_H };           /* meaning of ot_spec.consts */

/* n_in: 2 (BiasGelu[Tanh]) or 3 (the Mul ops: up, input 2, must have X's shape) */
static int plan_gelu(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, int n_in, ot_plan *plan,
                char *err, size_t err_len) {
  if (n_inputs != n_in || n_outputs != 1) {
    snprintf(err, err_len, "the kernel table gives this op %d inputs and %d outputs, the bias_gelu planner expects "
                           "%d and 1; the library is inconsistent, rebuild it", n_inputs, n_outputs, n_in);
    return 1;
  }
  const ot_desc *x = &in[0];
  if (ot_check_rows_by_h(x, op->inputs[0].name, err, err_len)) return 1;
  const int64_t h = x->dims[x->rank - 1];
  if (ot_check_vector(op, in, 1, h, err, err_len)) return 1;
  if (n_in == 3 && ot_check_same_shape(op, in, 2, 0, err, err_len)) return 1;
  const int64_t keys[N_KEYS] = {h % 16 == 0};
  const ot_spec *spec = ot_find_spec(op, keys, N_KEYS, plan->arch);
  if (!spec || spec->consts[CONST_ROWS] < 1 || spec->consts[CONST_BLOCK_H] < 1) {
    snprintf(err, err_len, "this library holds no kernel for H=%lld; rebuild it with the op included",
             (long long)h);
    return 1;
  }
  const int64_t rows = ot_row_count(x), per = spec->consts[CONST_ROWS], block = spec->consts[CONST_BLOCK_H];
  plan->spec = spec;
  plan->grid[0] = (unsigned)((rows + per - 1) / per);
  plan->grid[1] = (unsigned)((h + block - 1) / block);
  plan->grid[2] = 1;
  plan->outputs[0] = *x;
  return 0;
}

static int gelu_params(const ot_desc *in, void *const *ptrs, int n_in, void *storage, void **params) {
  const int32_t n_rows = (int32_t)ot_row_count(&in[0]); /* the plan checked it fits */
  const int32_t h = (int32_t)in[0].dims[in[0].rank - 1];
  uint64_t *slot = storage;
  int n = 0;
  for (int i = 0; i <= n_in; i++) ot_put_param(slot, params, n++, &ptrs[i], sizeof ptrs[i]); /* X, bias, (up,) Y */
  ot_put_param(slot, params, n++, &n_rows, sizeof n_rows);
  ot_put_param(slot, params, n++, &h, sizeof h);
  return n;
}

int ot_bias_gelu_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                      ot_plan *p, char *err, size_t err_len) {
  (void)attrs;
  return plan_gelu(op, in, n_inputs, n_outputs, 2, p, err, err_len);
}

int ot_bias_gelu_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                        const double *attrs, void *storage, void **p) {
  (void)op, (void)plan, (void)attrs;
  return gelu_params(in, ptrs, 2, storage, p);
}

int ot_bias_gelu_mul_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                          ot_plan *p, char *err, size_t err_len) {
  (void)attrs;
  return plan_gelu(op, in, n_inputs, n_outputs, 3, p, err, err_len);
}

int ot_bias_gelu_mul_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                            const double *attrs, void *storage, void **p) {
  (void)op, (void)plan, (void)attrs;
  return gelu_params(in, ptrs, 3, storage, p);
}
