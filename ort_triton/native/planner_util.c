/* planner_util.c: see planner_util.h. */
#include "planner_util.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

int64_t ot_row_count(const ot_desc *x) {
  for (size_t i = 0; i + 1 < x->rank; i++)
    if (x->dims[i] == 0) return 0; /* empty, however large the other dims */
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < x->rank; i++) {
    rows *= x->dims[i];
    if (rows > INT32_MAX) return -1; /* checked every step, so the product never overflows int64 */
  }
  return rows;
}

const char *ot_shape_text(const ot_desc *d, char *buf, size_t len) {
  size_t used = (size_t)snprintf(buf, len, "[");
  for (size_t i = 0; i < d->rank && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%lld", i ? "," : "", (long long)d->dims[i]);
  if (used < len) snprintf(buf + used, len - used, "]");
  return buf;
}

int ot_check_rows_by_h(const ot_desc *x, const char *name, char *err, size_t err_len) {
  if (x->rank < 1 || x->rank > 8) {
    snprintf(err, err_len, "input %s has rank %zu; it must have rank 1..8 (the op works along the last axis)", name,
             x->rank);
    return 1;
  }
  for (size_t i = 0; i < x->rank; i++) {
    if (x->dims[i] < 0) { /* ORT never passes these; the test hook can */
      snprintf(err, err_len, "input %s has a negative dimension", name);
      return 1;
    }
  }
  const int64_t h = x->dims[x->rank - 1];
  if (h < 1 || h > INT32_MAX) {
    snprintf(err, err_len, "input %s has last dimension H=%lld; H must be 1..%d", name, (long long)h, INT32_MAX);
    return 1;
  }
  if (ot_row_count(x) < 0) {
    snprintf(err, err_len, "input %s has more than %d rows (the product of all dimensions but the last); "
                           "split the batch", name, INT32_MAX);
    return 1;
  }
  return 0;
}

int ot_check_rank(const ot_op *op, const ot_desc *in, int index, size_t rank, const char *layout, char *err,
                  size_t err_len) {
  const ot_desc *d = &in[index];
  char shape[160];
  if (d->rank != rank) {
    snprintf(err, err_len, "input %s has shape %s; it must have rank %zu, %s", op->inputs[index].name,
             ot_shape_text(d, shape, sizeof shape), rank, layout);
    return 1;
  }
  for (size_t i = 0; i < rank; i++) {
    if (d->dims[i] < 0) { /* ORT never passes these; the test hook can */
      snprintf(err, err_len, "input %s has a negative dimension", op->inputs[index].name);
      return 1;
    }
  }
  return 0;
}

int ot_key_span(const ot_op *op, int n_keys, int key, int64_t *lo, int64_t *hi) {
  *lo = INT64_MAX, *hi = INT64_MIN;
  for (int s = 0; s < op->n_specs; s++) {
    const ot_spec *spec = &op->specs[s];
    if (spec->n_keys != n_keys) continue;
    if (spec->key_min[key] < *lo) *lo = spec->key_min[key];
    if (spec->key_max[key] > *hi) *hi = spec->key_max[key];
  }
  return *lo <= *hi;
}

void ot_key_values(const ot_op *op, int n_keys, int key, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (int s = 0; s < op->n_specs && used < len; s++) {
    const ot_spec *spec = &op->specs[s];
    if (spec->n_keys != n_keys) continue;
    int seen = 0; /* tuned specs come first, so a value can return after others: look at every earlier one */
    for (int e = 0; e < s && !seen; e++)
      seen = op->specs[e].n_keys == n_keys && op->specs[e].key_min[key] == spec->key_min[key] &&
             op->specs[e].key_max[key] == spec->key_max[key];
    if (seen) continue;
    if (spec->key_min[key] == spec->key_max[key])
      used += (size_t)snprintf(buf + used, len - used, "%s%lld", used ? ", " : "", (long long)spec->key_min[key]);
    else
      used += (size_t)snprintf(buf + used, len - used, "%s%lld..%lld", used ? ", " : "",
                               (long long)spec->key_min[key], (long long)spec->key_max[key]);
  }
}

int ot_check_vector(const ot_op *op, const ot_desc *in, int index, int64_t h, char *err, size_t err_len) {
  const ot_desc *v = &in[index];
  if (v->rank == 1 && v->dims[0] == h) return 0;
  char shape[160];
  snprintf(err, err_len, "input %s has shape %s; it must be [%lld], the last dimension (H) of input %s",
           op->inputs[index].name, ot_shape_text(v, shape, sizeof shape), (long long)h, op->inputs[0].name);
  return 1;
}

int ot_check_same_shape(const ot_op *op, const ot_desc *in, int index, int ref, char *err, size_t err_len) {
  const ot_desc *v = &in[index], *r = &in[ref];
  if (v->rank == r->rank && memcmp(v->dims, r->dims, r->rank * sizeof r->dims[0]) == 0) return 0;
  char a[160], b[160];
  snprintf(err, err_len, "input %s has shape %s but input %s has shape %s; they must be equal (no broadcasting)",
           op->inputs[index].name, ot_shape_text(v, a, sizeof a), op->inputs[ref].name, ot_shape_text(r, b, sizeof b));
  return 1;
}

void ot_put_param(uint64_t *slots, void **params, int i, const void *value, size_t size) {
  memcpy(&slots[i], value, size);
  params[i] = &slots[i];
}

int ot_plan_row_blocks(const ot_op *op, const ot_spec *spec, const ot_desc *x, int64_t n_rows, int n_outputs,
                       int64_t rows_per_program, ot_plan *plan, char *err, size_t err_len) {
  if (rows_per_program < 1) {
    snprintf(err, err_len, "kernel %s has ROWS_PER_PROGRAM=%lld in the kernel table; rebuild the library",
             spec->kernel_name, (long long)rows_per_program);
    return 1;
  }
  plan->spec = spec;
  plan->grid[0] = (unsigned)((n_rows + rows_per_program - 1) / rows_per_program);
  plan->grid[1] = 1;
  plan->grid[2] = 1;
  for (int o = 0; o < n_outputs; o++) {
    plan->outputs[o] = *x;
    plan->outputs[o].type = op->outputs[o].type;
  }
  return 0;
}

int ot_grid_programs(int64_t rows, int64_t block_m, int64_t batch, int64_t heads, const char *rows_name,
                     const char *heads_name, int64_t *programs, char *err, size_t err_len) {
  const int64_t tiles = (rows + block_m - 1) / block_m;
  const int64_t factors[2] = {batch, heads};
  int64_t n = tiles;
  for (int i = 0; i < 2; i++) {
    if (n > 0 && factors[i] > INT32_MAX / n) {
      snprintf(err, err_len, "the launch needs ceil(%s / %lld) * B * %s = %lld * %lld * %lld programs, more than "
                             "the %d a CUDA grid holds; split the batch",
               rows_name, (long long)block_m, heads_name, (long long)tiles, (long long)batch, (long long)heads,
               INT32_MAX);
      return 1;
    }
    n *= factors[i];
  }
  *programs = n;
  return 0;
}

int ot_kv_seq_major(double seq_major, const char *heads_first, const char *seq_first, char *err, size_t err_len) {
  if (seq_major == 0 || seq_major == 1) return seq_major == 1;
  snprintf(err, err_len, "attribute seq_major is %g; it must be 0 (%s) or 1 (%s)", seq_major, heads_first, seq_first);
  return -1;
}

int64_t ot_k_align(int64_t k) {
  int64_t a = 1;
  while (a < 4096 && k % (2 * a) == 0) a *= 2;
  return a;
}
