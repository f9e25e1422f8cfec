/* rotary.c: planner and kernel parameters for Rotary and TransposeRotary (contracts: ort_triton/ops/rotary.py;
 * kernel: ort_triton/kernels/rotary.py, its X_BSND a constexpr of the spec).
 *
 * Inputs:  X [B, N, S, D] (TransposeRotary: [B, S, N, D]); cos [B', S', W] or [B', 1, S', W] with B' in {1, B},
 *          S' in {1, S}, W = R or R/2; sin cos's shape.
 * Output:  Y [B, N, S, D].
 * Attributes (contract order): interleaved (0 or 1), rotary_dim (R; 0: D; even, 2..D).
 * Dispatch keys: (D, both D and W multiples of 16, half_split: not interleaved and R = D); per BLOCK_D a half-split
 * spec for D = BLOCK_D, then an aligned spec and one for any; consts = (BLOCK_S, BLOCK_D).
 * Grid: (ceil(S / BLOCK_S), N, B). */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "ot_table.h"
#include "planner_util.h"

enum { IN_X, IN_COS, IN_SIN, N_INPUTS };
enum { N_ATTRS = 2 }; /* interleaved, rotary_dim: OT_ROTARY_* in planner_util.h */
enum { KEY_HEAD_DIM, KEY_ALIGNED, KEY_HALF_SPLIT, N_KEYS };
enum { CONST_BLOCK_S, CONST_BLOCK_D };

static int integral(double v, double lo, double hi) { return v >= lo && v <= hi && v == (double)(int64_t)v; }

int ot_rotary_cos(const ot_op *op, const ot_desc *in, int in_x, int in_cos, int in_sin, const double *attrs,
                  ot_rotary_shape *out, char *err, size_t err_len) {
  const ot_desc *x = &in[in_x], *cos = &in[in_cos], *sin = &in[in_sin];
  const char *xn = op->inputs[in_x].name, *cn = op->inputs[in_cos].name;
  char a[160], b[160];
  if (!integral(attrs[OT_ROTARY_INTERLEAVED], 0, 1)) {
    snprintf(err, err_len, "attribute interleaved=%g must be 0 or 1", attrs[OT_ROTARY_INTERLEAVED]);
    return 1;
  }
  if (!integral(attrs[OT_ROTARY_DIM], 0, INT32_MAX)) {
    snprintf(err, err_len, "attribute rotary_dim=%g must be an integer >= 0", attrs[OT_ROTARY_DIM]);
    return 1;
  }
  out->r = (int64_t)attrs[OT_ROTARY_DIM] ? (int64_t)attrs[OT_ROTARY_DIM] : out->d;
  if (out->r % 2 || out->r < 2 || out->r > out->d) {
    snprintf(err, err_len, "rotary_dim %lld must be even and in 2..head_dim (%lld, from input %s)", (long long)out->r,
             (long long)out->d, xn);
    return 1;
  }
  /* cos [B', S', W] or [B', 1, S', W]: read as rank 3 */
  const int rank4 = cos->rank == 4;
  if ((cos->rank != 3 && !rank4) || (rank4 && cos->dims[1] != 1)) {
    snprintf(err, err_len, "input %s has shape %s; it must be [B or 1, S or 1, W] or [B or 1, 1, S or 1, W]", cn,
             ot_shape_text(cos, a, sizeof a));
    return 1;
  }
  if (sin->rank != cos->rank || memcmp(sin->dims, cos->dims, cos->rank * sizeof cos->dims[0]) != 0) {
    snprintf(err, err_len, "input %s has shape %s but input %s has shape %s; they must be equal",
             op->inputs[in_sin].name, ot_shape_text(sin, a, sizeof a), cn, ot_shape_text(cos, b, sizeof b));
    return 1;
  }
  const int64_t cb = cos->dims[0], cs = cos->dims[rank4 ? 2 : 1];
  out->w = cos->dims[rank4 ? 3 : 2];
  if ((cb != 1 && cb != out->batch) || (cs != 1 && cs != out->seq) || (out->w != out->r && 2 * out->w != out->r)) {
    snprintf(err, err_len, "input %s has shape %s for input %s of shape %s and rotary_dim %lld; its batch must be "
                           "1 or B, its sequence 1 or S and its last dim rotary_dim or rotary_dim / 2",
             cn, ot_shape_text(cos, a, sizeof a), xn, ot_shape_text(x, b, sizeof b), (long long)out->r);
    return 1;
  }
  if (cb * cs * out->w > INT32_MAX) { /* the kernel's cos strides are int32 */
    snprintf(err, err_len, "input %s has more than %d elements", cn, INT32_MAX);
    return 1;
  }
  out->cos_s = cs > 1 ? out->w : 0; /* stride 0: one row for every position (or batch) */
  out->cos_b = cb > 1 ? cs * out->w : 0;
  return 0;
}

/* bsnd: X is [B, S, N, D] (TransposeRotary) */
static int shape_of(const ot_op *op, const ot_desc *in, const double *attrs, int bsnd, ot_rotary_shape *out,
                    char *err, size_t err_len) {
  const ot_desc *x = &in[IN_X];
  if (ot_check_rank(op, in, IN_X, 4, bsnd ? "[B, S, num_heads, head_dim]" : "[B, num_heads, S, head_dim]", err,
                    err_len))
    return 1;
  out->batch = x->dims[0], out->heads = x->dims[bsnd ? 2 : 1], out->seq = x->dims[bsnd ? 1 : 2], out->d = x->dims[3];
  return ot_rotary_cos(op, in, IN_X, IN_COS, IN_SIN, attrs, out, err, err_len);
}

static int plan_rotary(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                       int bsnd, ot_plan *plan, char *err, size_t err_len) {
  if (n_inputs != N_INPUTS || n_outputs != 1 || op->n_attrs != N_ATTRS) {
    snprintf(err, err_len, "the kernel table gives this op %d inputs, %d outputs and %d attributes, the rotary "
                           "planner expects 3, 1 and 2; the library is inconsistent, rebuild it",
             n_inputs, n_outputs, op->n_attrs);
    return 1;
  }
  ot_rotary_shape sh;
  if (shape_of(op, in, attrs, bsnd, &sh, err, err_len)) return 1;
  const int64_t keys[N_KEYS] = {sh.d, sh.d % 16 == 0 && sh.w % 16 == 0, !attrs[OT_ROTARY_INTERLEAVED] && sh.r == sh.d};
  const ot_spec *spec = ot_find_spec(op, keys, N_KEYS, plan->arch);
  if (!spec) {
    snprintf(err, err_len, "head_dim %lld (dim 3 of input %s) is not supported; this library's kernels take "
                           "head_dim up to %lld", (long long)sh.d, op->inputs[IN_X].name,
             op->n_specs ? (long long)op->specs[op->n_specs - 1].key_max[KEY_HEAD_DIM] : 0LL);
    return 1;
  }
  const int64_t block_s = spec->consts[CONST_BLOCK_S], block_d = spec->consts[CONST_BLOCK_D];
  if (block_s < 1 || block_d < sh.d) {
    snprintf(err, err_len, "kernel %s has BLOCK_S=%lld, BLOCK_D=%lld in the kernel table for head_dim %lld; rebuild "
                           "the library", spec->kernel_name, (long long)block_s, (long long)block_d, (long long)sh.d);
    return 1;
  }
  if (sh.seq > INT32_MAX - block_s || sh.heads > 65535 || sh.batch > 65535) { /* int32 rows; grid.y, grid.z */
    snprintf(err, err_len, "input %s is [B, N, S, D] = %lld x %lld x %lld x %lld; this kernel takes S up to %lld "
                           "and B and N up to 65535", op->inputs[IN_X].name, (long long)sh.batch,
             (long long)sh.heads, (long long)sh.seq, (long long)sh.d, (long long)(INT32_MAX - block_s));
    return 1;
  }
  plan->spec = spec;
  plan->grid[0] = (unsigned)((sh.seq + block_s - 1) / block_s);
  plan->grid[1] = (unsigned)sh.heads;
  plan->grid[2] = (unsigned)sh.batch;
  plan->outputs[0] = in[IN_X];
  plan->outputs[0].dims[1] = sh.heads, plan->outputs[0].dims[2] = sh.seq; /* [B, N, S, D] */
  return 0;
}

static int params_rotary(const ot_op *op, const ot_desc *in, void *const *ptrs, const double *attrs, int bsnd,
                         void *storage, void **params) {
  ot_rotary_shape sh;
  char err[8];
  if (shape_of(op, in, attrs, bsnd, &sh, err, sizeof err)) return -1; /* the plan has checked them */
  const int32_t v[8] = {(int32_t)sh.heads, (int32_t)sh.seq, (int32_t)sh.d, (int32_t)sh.r, (int32_t)sh.cos_b,
                        (int32_t)sh.cos_s, sh.w != sh.r, (int32_t)attrs[OT_ROTARY_INTERLEAVED]};
  uint64_t *slot = storage;
  int n = 0;
  for (int i = 0; i < 4; i++) ot_put_param(slot, params, n++, &ptrs[i], sizeof ptrs[i]); /* X, cos, sin, Y */
  for (int i = 0; i < 8; i++) ot_put_param(slot, params, n++, &v[i], sizeof v[i]); /* N, S, D, R, strides, flags */
  return n;
}

int ot_rotary_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                   ot_plan *plan, char *err, size_t err_len) {
  return plan_rotary(op, in, n_inputs, n_outputs, attrs, 0, plan, err, err_len);
}

int ot_rotary_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs, const double *attrs,
                     void *storage, void **params) {
  (void)plan;
  return params_rotary(op, in, ptrs, attrs, 0, storage, params);
}

int ot_transpose_rotary_plan(const ot_op *op, const ot_desc *in, int n_inputs, int n_outputs, const double *attrs,
                             ot_plan *plan, char *err, size_t err_len) {
  return plan_rotary(op, in, n_inputs, n_outputs, attrs, 1, plan, err, err_len);
}

int ot_transpose_rotary_params(const ot_op *op, const ot_plan *plan, const ot_desc *in, void *const *ptrs,
                               const double *attrs, void *storage, void **params) {
  (void)plan;
  return params_rotary(op, in, ptrs, attrs, 1, storage, params);
}
