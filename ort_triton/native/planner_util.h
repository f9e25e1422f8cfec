/* planner_util.h: helpers every op planner needs (row counts, shape text, kernel parameter slots). */
#ifndef OT_PLANNER_UTIL_H
#define OT_PLANNER_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "ot_table.h"

/* The product of all dims but the last (the rows of a [..., H] tensor); 0 if any of them is 0; -1 if it
 * exceeds int32 (the kernels' row index). */
int64_t ot_row_count(const ot_desc *x);

/* "[2,3,768]" into buf; returns buf. */
const char *ot_shape_text(const ot_desc *d, char *buf, size_t len);

/* Checks rank 1..8 and no negative dim, and that the last dim is 1..INT32_MAX; writes the error for input
 * `name` and returns 1 otherwise. */
int ot_check_rows_by_h(const ot_desc *x, const char *name, char *err, size_t err_len);

/* Input `index` of op must have `rank` dims, none negative; `layout` names them in the message, e.g.
 * "[B, S, num_heads * head_dim]". */
int ot_check_rank(const ot_op *op, const ot_desc *in, int index, size_t rank, const char *layout, char *err,
                  size_t err_len);

/* The least key_min and greatest key_max of key `key` over the op's specs of n_keys keys (tuned and built-in
 * alike); 0 when it has none (a library built without the op), else 1. */
int ot_key_span(const ot_op *op, int n_keys, int key, int64_t *lo, int64_t *hi);

/* The ranges key `key` takes over those specs, each once in table order, into buf: "32, 40, 64" ("lo..hi"
 * where a spec covers a range); "" when there are none. For the messages that list what a library holds. */
void ot_key_values(const ot_op *op, int n_keys, int key, char *buf, size_t len);

/* Input `index` of op must be exactly [h] (a per-column vector such as gamma, beta or a bias). */
int ot_check_vector(const ot_op *op, const ot_desc *in, int index, int64_t h, char *err, size_t err_len);

/* Input `index` of op must have input `ref`'s shape exactly (an elementwise partner: skip, up; no broadcasting). */
int ot_check_same_shape(const ot_op *op, const ot_desc *in, int index, int ref, char *err, size_t err_len);

/* The plan of a row-wise kernel (LayerNorm, RMSNorm): `spec`, one program per `rows_per_program` rows of x,
 * every output shaped like x in its own element type. Fails (a message, 1) on a table whose rows per
 * program is not positive. */
int ot_plan_row_blocks(const ot_op *op, const ot_spec *spec, const ot_desc *x, int64_t n_rows, int n_outputs,
                       int64_t rows_per_program, ot_plan *plan, char *err, size_t err_len);

/* The programs of an attention grid, ceil(rows / block_m) * batch * heads, each factor checked before it
 * multiplies so nothing overflows, against grid.x's limit (also the kernels' int32 program id). rows_name
 * and heads_name say what rows and heads are in the message ("Sq", "num_heads"). Fails (a message, 1). */
int ot_grid_programs(int64_t rows, int64_t block_m, int64_t batch, int64_t heads, const char *rows_name,
                     const char *heads_name, int64_t *programs, char *err, size_t err_len);

/* Rotary's cos/sin and attributes (rotary.c), for every op that applies it (Rotary, TransposeRotary,
 * QKVRotaryCache): attrs[OT_ROTARY_INTERLEAVED], attrs[OT_ROTARY_DIM] in the op's contract order; out's batch,
 * seq and d set by the caller from its input in_x (named, with its shape, in the messages). Checks the
 * attributes and cos, sin against them; fills r, w and the cos strides. Fails (a message, 1). */
enum { OT_ROTARY_INTERLEAVED, OT_ROTARY_DIM };
typedef struct {
  int64_t batch, heads, seq, d, r, w, cos_b, cos_s;
} ot_rotary_shape;
int ot_rotary_cos(const ot_op *op, const ot_desc *in, int in_x, int in_cos, int in_sin, const double *attrs,
                  ot_rotary_shape *out, char *err, size_t err_len);

/* The largest power of two dividing k, at most 4096 (ops/linear.py K_ALIGN_CAP, which ops/norm_linear.py shares): a
 * spec that loads whole BLOCK_K tiles unmasked needs BLOCK_K to divide K (Linear's and AddRMSNorm*'s K_ALIGN key). */
int64_t ot_k_align(int64_t k);

/* The seq_major attribute of the ops that write or read a KV cache (ops/kv_layout.py): 1 for the cache sequence first,
 * 0 heads first; any other value writes the error, naming both layouts as the op describes them (heads_first,
 * seq_first), and returns -1. */
int ot_kv_seq_major(double seq_major, const char *heads_first, const char *seq_first, char *err, size_t err_len);

/* storage holds OT_MAX_PARAMS 8-byte slots; parameter i gets slot i, and cuLaunchKernel reads from it as
 * many bytes as the kernel's signature says (8 for pointers, 4 for int32/float32). */
void ot_put_param(uint64_t *slots, void **params, int i, const void *value, size_t size);

#endif
