/* ot_table.h: the tables that ort_triton/aot/codegen.py generates from the op contracts
 * (ort_triton/ops/<op>.py), and the interface between those tables and the hand-written C.
 *
 * The generated file (ot_table_gen.c) defines ot_ops[], ot_n_ops, ot_domain, ot_domain_version and
 * the kernel images (cubins, embedded with .incbin). Nothing here is written by hand twice: names,
 * inputs, attributes and specialisations come from Python.
 */
#ifndef OT_TABLE_H
#define OT_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "onnxruntime_c_api.h"

#define OT_MAX_IO 8
#define OT_MAX_ATTRS 4
#define OT_MAX_KEYS 8
#define OT_MAX_CONSTS 8
#define OT_MAX_ARCHS 8
#define OT_MAX_PARAMS 24

/* One compiled kernel image: one specialisation for one GPU arch. */
typedef struct {
  int arch;                   /* 10 * major + minor: 80, 86, 89, 90 */
  const unsigned char *image; /* cubin bytes */
  size_t image_size;
  unsigned shared_bytes;      /* dynamic shared memory the launch needs */
  unsigned num_warps;         /* block = 32 * num_warps threads */
  unsigned global_scratch;    /* Triton's global scratch a program (device-made TMA descriptors), 0 for none */
  unsigned pdl;               /* 1: launch with programmatic stream serialization (contract.Kernel.pdl) */
} ot_image;

/* One specialisation: a kernel with its constexprs fixed, compiled for several archs.
 * It is chosen when every dispatch key the op's C code computes lies in [key_min, key_max]. */
typedef struct {
  const char *kernel_name;    /* the function's name inside the cubin */
  int n_images;
  ot_image images[OT_MAX_ARCHS];
  int n_keys;
  int64_t key_min[OT_MAX_KEYS];
  int64_t key_max[OT_MAX_KEYS];
  int64_t consts[OT_MAX_CONSTS]; /* launch constants (block sizes...), meaning fixed by the op's C code */
  int index;                  /* position in the op's spec list, for the module cache */
} ot_spec;

typedef struct {
  const char *name;
  ONNXTensorElementDataType type;
  int optional;               /* 1: OPTIONAL, 0: REQUIRED */
} ot_io;

enum { OT_ATTR_FLOAT = 1, OT_ATTR_INT = 2 };

typedef struct {
  const char *name;
  int kind;                   /* OT_ATTR_FLOAT or OT_ATTR_INT */
  double default_value;
} ot_attr;

struct ot_op;

/* Bytes per element of the contracts' tensor types (0 for any other: a contract lists its types). */
static inline size_t ot_element_size(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return 2;
    default: return 0;
  }
}

/* A tensor as the planner sees it: no data, so plans can be checked on a machine without a GPU. */
typedef struct {
  int present;
  ONNXTensorElementDataType type;
  size_t rank;
  int64_t dims[8];
} ot_desc;

/* A GEMM a plan hands to cuBLAS instead of a kernel of ours (Linear beyond one row: cuBLAS is the
 * library's GEMM, Triton's GEMV its one-row kernel). Column-major, as cublasGemmEx takes it:
 * C[m, n] = op(A)[m, k] op(B)[k, n], A, B and C the pointers at ptrs[a], ptrs[b], ptrs[c] (inputs, then
 * outputs, then from OT_PTR_WS the plan's workspace regions), op the transpose when trans_a / trans_b; fp32
 * accumulation. m == 0: no GEMM. */
#define OT_MAX_WS 4                 /* workspace regions a plan may name */
#define OT_PTR_WS (2 * OT_MAX_IO)   /* ptrs[OT_PTR_WS + j]: the workspace plus ot_plan.ws_offsets[j] */
#define OT_MAX_GEMMS 2              /* cuBLAS GEMMs a plan may run */
typedef struct {
  int64_t m, n, k, lda, ldb, ldc;
  int trans_a, trans_b;
  int a, b, c;
} ot_gemm;

/* What a planner decides: which specialisation, which grid, the output shapes. `arch` is the one input:
 * the GPU the plan is for (10 * major + minor; 0 for any), set by the caller, read by ot_find_spec.
 * A plan may launch its kernel twice (a split and its merge: CausalAttention's decode), the second time on
 * grid2, both over one device workspace of scratch_bytes that compute takes from ORT's arena; compute
 * sets `launch` (0, 1) and `scratch` before it asks the params function for each launch. */
typedef struct {
  int arch;
  const ot_spec *spec;
  unsigned grid[3];
  ot_desc outputs[OT_MAX_IO];   /* shape of each output the node asks for */
  int n_launches;               /* 1 (0 counts as 1) or 2 */
  unsigned grid2[3];
  size_t scratch_bytes;
  int64_t values[4];            /* the planner's own numbers for its params function */
  int launch;                   /* set by compute: which launch the params are for */
  void *scratch;                /* set by compute: the workspace, NULL when scratch_bytes is 0 */
  /* A two-launch plan that can run as one, given this many zeroed 32-bit counters that each launch leaves zeroed
   * (CausalAttention's fused merge); 0: none. At most OT_MERGE_COUNTERS. */
  size_t merge_counters;
  void *counters;               /* set by compute: those counters, the plan then one launch on grid; else NULL */
  /* gemms[0].m > 0 with spec NULL: cuBLAS runs the node, no kernel of ours. With a spec: launch 0, then each gemm
   * with m > 0 in order, then the remaining launches: a fused op's steps beyond its fused kernel's rows
   * (AddRMSNormSwiGLU: the gate's GEMM and the up's). */
  ot_gemm gemms[OT_MAX_GEMMS];
  size_t ws_offsets[OT_MAX_WS]; /* byte offsets into the workspace of the regions ptrs[OT_PTR_WS + j] name */
  /* A plan whose last programs only copy inputs into outputs (a cache op's past into its present) launches
   * alias_grid0 programs instead of grid[0] when the caller bound every such output over its input (output
   * alias_out[j]'s pointer is input alias_in[j]'s, for each j < n_alias: nothing to copy). 0 programs: none. */
  int n_alias;
  int alias_in[2], alias_out[2];
  unsigned alias_grid0;
} ot_plan;

/* Merge counters a node keeps per CUDA stream (ops/causal_attention.py MERGE_COUNTERS, the same number). */
#define OT_MERGE_COUNTERS 4096

/* Per-op hand-written C (e.g. layer_norm.c).
 * plan:   check inputs (dtype, rank, shapes) and attributes, pick a spec, compute grid and output shapes; on
 *         error write a message that names the op, the input and what is supported into err and return
 *         nonzero. attrs: the attribute values in contract order, as for params.
 * params: fill the kernel parameter array (without the two trailing scratch pointers) for a plan;
 *         ptrs holds the device pointers of inputs then outputs (NULL where absent), attrs the
 *         attribute values in contract order. Returns the number of params written. */
typedef int (*ot_plan_fn)(const struct ot_op *op, const ot_desc *inputs, int n_inputs, int n_outputs,
                          const double *attrs, ot_plan *plan, char *err, size_t err_len);
typedef int (*ot_params_fn)(const struct ot_op *op, const ot_plan *plan, const ot_desc *inputs,
                            void *const *ptrs, const double *attrs, void *storage, void **params);

/* One registration: one op name for one concrete element type (ORT picks it by the node's type). */
typedef struct ot_op {
  const char *name;
  ONNXTensorElementDataType type;
  int n_inputs;
  ot_io inputs[OT_MAX_IO];
  int n_outputs;
  ot_io outputs[OT_MAX_IO];
  int n_attrs;
  ot_attr attrs[OT_MAX_ATTRS];
  int n_specs;
  const ot_spec *specs;
  int n_tuned;                /* specs (the first ones, from a tuning table) built for fewer archs than the
                               * library: nonzero makes compute ask the GPU's arch before dispatch */
  ot_plan_fn plan;
  ot_params_fn params;
} ot_op;

extern const ot_op ot_ops[];
extern const int ot_n_ops;
extern const char ot_domain[];
extern const int ot_domain_version;
extern const char ot_build_info[]; /* e.g. "archs=80,86,89,90 triton=3.6.0" */

/* Generic helper shared by the planners: the first spec whose keys all fit and that holds an image for
 * arch (a spec tuned on one GPU is built for that arch only, ahead of the defaults: ort-triton tune); when
 * none holds one (or arch is 0), the first whose keys fit, whose missing image the launch then reports.
 * NULL when no spec's keys fit. */
const ot_spec *ot_find_spec(const ot_op *op, const int64_t *keys, int n_keys, int arch);

#endif
