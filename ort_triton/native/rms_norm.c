/* rms_norm.c: planner and kernel parameters for RMSNorm and AddRMSNorm, which share one Triton kernel:
 * Y = s / sqrt(mean(s^2) + epsilon) * gamma over the last axis (fp32 inside), where s = X for RMSNorm and
 * s = X + skip (rounded to the element type) for AddRMSNorm, which can also store sum = s.
 *
 * RMSNorm inputs:    X, gamma        outputs: Y
 * AddRMSNorm inputs: X, skip, gamma  outputs: Y, sum (optional)
 * The generic code (ort_triton.c) has already checked presence of required inputs and element types. */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "ot_table.h"
#include "planner_util.h"

/* Dispatch keys, in the order the op contract lists them. */
enum { KEY_STORE_SUM, KEY_H_DIV16, KEY_H, KEY_ROWS, N_KEYS };
/* Meaning of ot_spec.consts for this kernel. */
enum { CONST_BLOCK_H, CONST_ROWS_PER_PROGRAM };

/* AddRMSNorm has skip at 1, shifting gamma by one. */
enum { SKIP_INDEX = 1 };
static int has_skip(const ot_op *op) { return strcmp(op->name, "AddRMSNorm") == 0; }
static int gamma_index(const ot_op *op) { return 1 + has_skip(op); }

/* Says why no spec fits: H outside everything the table covers, or a combination it lacks. */
static void no_spec_error(const ot_op *op, const int64_t *keys, char *err, size_t err_len) {
  int64_t lo, hi;
  if (!ot_key_span(op, N_KEYS, KEY_H, &lo, &hi))
    snprintf(err, err_len, "this library holds no kernels for this op; rebuild it with the op included");
  else if (keys[KEY_H] < lo || keys[KEY_H] > hi)
    snprintf(err, err_len, "hidden size H=%lld is not supported (this library covers %lld..%lld)",
             (long long)keys[KEY_H], (long long)lo, (long long)hi);
  else
    snprintf(err, err_len,
             "hidden size H=%lld is not supported%s (this library covers %lld..%lld, but not this "
             "combination); rebuild the library with it",
             (long long)keys[KEY_H],
             has_skip(op) ? (keys[KEY_STORE_SUM] ? " with the sum output" : " without the sum output") : "",
             (long long)lo, (long long)hi);
}

int ot_rms_norm_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                     ot_plan *plan, char *err, size_t err_len) {
  (void)attrs;
  const int skip = has_skip(op);
  if (n_inputs != 2 + skip || op->n_outputs != 1 + skip) {
    snprintf(err, err_len, "the kernel table gives this op %d inputs and %d outputs, the rms_norm planner "
                           "expects %d and %d; the library is inconsistent, rebuild it",
             n_inputs, op->n_outputs, 2 + skip, 1 + skip);
    return 1;
  }

  const ot_desc *x = &in[0];
  const char *x_name = op->inputs[0].name;
  if (ot_check_rows_by_h(x, x_name, err, err_len)) return 1;
  const int64_t h = x->dims[x->rank - 1];
  const int64_t n_rows = ot_row_count(x); /* checked above: 0..INT32_MAX */
  if (skip && ot_check_same_shape(op, in, SKIP_INDEX, 0, err, err_len)) return 1;
  if (ot_check_vector(op, in, gamma_index(op), h, err, err_len)) return 1;

  const int64_t keys[N_KEYS] = {skip && n_outputs == 2, h % 16 == 0, h, n_rows};
  const ot_spec *spec = ot_find_spec(op, keys, N_KEYS, plan->arch);
  if (!spec) {
    no_spec_error(op, keys, err, err_len);
    return 1;
  }
  return ot_plan_row_blocks(op, spec, x, n_rows, n_outputs, spec->consts[CONST_ROWS_PER_PROGRAM], plan, err,
                            err_len);
}

int ot_rms_norm_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                       const double *attrs, void *storage, void **params) {
  (void)plan; /* the spec's constants are compiled into the kernel; only shapes are passed */
  const int skip = has_skip(op);
  const int n_in = op->n_inputs;
  void *const pointers[5] = {
      ptrs[0],                        /* X */
      skip ? ptrs[SKIP_INDEX] : NULL, /* R: skip (read only with the residual) */
      ptrs[gamma_index(op)],          /* W: gamma */
      ptrs[n_in],                     /* Y */
      skip ? ptrs[n_in + 1] : NULL,   /* S: sum, NULL when the node does not ask for it */
  };
  const int32_t n_rows = (int32_t)ot_row_count(&in[0]); /* the plan checked it fits */
  const int32_t h = (int32_t)in[0].dims[in[0].rank - 1];
  const float eps = (float)attrs[0];

  uint64_t *slot = storage;
  int n = 0;
  for (int i = 0; i < 5; i++) ot_put_param(slot, params, n++, &pointers[i], sizeof pointers[i]);
  ot_put_param(slot, params, n++, &n_rows, sizeof n_rows);
  ot_put_param(slot, params, n++, &h, sizeof h);
  ot_put_param(slot, params, n++, &eps, sizeof eps);
  return n;
}
