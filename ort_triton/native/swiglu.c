/* swiglu.c: planner and kernel parameters for SiluMul (contract: ort_triton/ops/swiglu.py; kernel:
 * ort_triton/kernels/swiglu.py), Y = silu(gate) * up elementwise over [rows, I].
 * Inputs: gate [..., I], up (gate's shape). Output: Y, gate's shape.
 * Grid: (ceil(rows / ROWS), ceil(I / BLOCK_I)); spec consts = (ROWS, BLOCK_I). */
#include <stdio.h>

#include "ot_table.h"
#include "planner_util.h"

enum { IN_GATE, IN_UP, N_INPUTS };
enum { KEY_I_DIV16, N_KEYS };       /* dispatch keys, in contract order */
enum { CONST_ROWS, CONST_BLOCK_I }; /* meaning of ot_spec.consts */

int ot_silu_mul_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                     ot_plan *plan, char *err, size_t err_len) {
  (void)attrs;
  if (n_inputs != N_INPUTS || n_outputs != 1) {
    snprintf(err, err_len, "the kernel table gives this op %d inputs and %d outputs, the silu_mul planner expects "
                           "2 and 1; the library is inconsistent, rebuild it", n_inputs, n_outputs);
    return 1;
  }
  const ot_desc *gate = &in[IN_GATE];
  if (ot_check_rows_by_h(gate, op->inputs[IN_GATE].name, err, err_len)) return 1;
  if (ot_check_same_shape(op, in, IN_UP, IN_GATE, err, err_len)) return 1;
  const int64_t width = gate->dims[gate->rank - 1];
  const int64_t keys[N_KEYS] = {width % 16 == 0};
  const ot_spec *spec = ot_find_spec(op, keys, N_KEYS, plan->arch);
  if (!spec || spec->consts[CONST_ROWS] < 1 || spec->consts[CONST_BLOCK_I] < 1) {
    snprintf(err, err_len, "this library holds no kernel for I=%lld; rebuild it with the op included",
             (long long)width);
    return 1;
  }
  const int64_t rows = ot_row_count(gate), per = spec->consts[CONST_ROWS], block = spec->consts[CONST_BLOCK_I];
  const int64_t col_blocks = (width + block - 1) / block;
  if (col_blocks > 65535) { /* grid.y's limit */
    snprintf(err, err_len, "input %s has last dimension I=%lld; this kernel takes I up to %lld",
             op->inputs[IN_GATE].name, (long long)width, (long long)(65535 * block));
    return 1;
  }
  plan->spec = spec;
  plan->grid[0] = (unsigned)((rows + per - 1) / per); /* rows <= INT32_MAX: checked above */
  plan->grid[1] = (unsigned)col_blocks;
  plan->grid[2] = 1;
  plan->outputs[0] = *gate;
  return 0;
}

int ot_silu_mul_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                       const double *attrs, void *storage, void **params) {
  (void)op, (void)plan, (void)attrs;
  const int32_t n_rows = (int32_t)ot_row_count(&in[IN_GATE]); /* the plan checked it fits */
  const int32_t width = (int32_t)in[IN_GATE].dims[in[IN_GATE].rank - 1];
  uint64_t *slot = storage;
  int n = 0;
  for (int i = 0; i < 3; i++) ot_put_param(slot, params, n++, &ptrs[i], sizeof ptrs[i]); /* gate, up, Y */
  ot_put_param(slot, params, n++, &n_rows, sizeof n_rows);
  ot_put_param(slot, params, n++, &width, sizeof width);
  return n;
}
