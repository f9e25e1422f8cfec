/* ort_triton.c: registers every entry of ot_ops[] as an ONNX Runtime CUDA custom op and runs it:
 * gather the inputs, let the op's planner pick a specialisation, allocate the outputs, launch.
 * Also exports the hooks the Python tests use to check plans on machines without a GPU. */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cublas.h"
#include "cuda_driver.h"
#include "ot_table.h"
#include "planner_util.h"

#define OT_EXPORT __attribute__((visibility("default")))
#define OT_MSG_LEN 1024

/* ORT hands the OrtCustomOp pointer back to every callback; putting it first lets us recover the table
 * entry from it. */
typedef struct {
  OrtCustomOp base;
  const ot_op *op;
} ot_custom_op;

/* Nodes this process ran through our kernels (one count per node, whether it took one launch or a split's
 * two): lets tests prove a node ran our kernel and not its function body. */
static atomic_long launches;

static const ot_op *table_op(const OrtCustomOp *base) { return ((const ot_custom_op *)base)->op; }

/* A node's merge counters on one CUDA stream (ot_plan.merge_counters). */
typedef struct ot_counters {
  void *stream, *ctx, *ptr;
  struct ot_counters *next;
} ot_counters;

/* Per-node state; read-only after creation but for the merge counters, which `lock` guards, so concurrent runs of
 * one session may share it. */
typedef struct {
  const OrtApi *api;
  const ot_op *op;
  int n_outputs;               /* outputs the node really has: trailing unnamed ("") ones dropped */
  double attrs[OT_MAX_ATTRS];  /* in contract order */
  pthread_mutex_t lock;
  ot_counters *counters;       /* one buffer per stream the node ran on: concurrent runs may use other streams */
} ot_kernel;

/* ONNX's names for the element types, indexed by ONNXTensorElementDataType. */
static const char *type_name(ONNXTensorElementDataType type) {
  static const char *const names[] = {
      "undefined", "float",  "uint8",  "int8",      "uint16",     "int16",        "int32",
      "int64",     "string", "bool",   "float16",   "double",     "uint32",       "uint64",
      "complex64", "complex128", "bfloat16", "float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz",
      "uint4",     "int4",
  };
  return (unsigned)type < sizeof names / sizeof names[0] ? names[type] : "unknown";
}

/* Every message the library returns starts with the op and its element type, so a failing node in a
 * large model can be found. */
static void prefix_message(const ot_op *op, const char *detail, char *msg, size_t msg_len) {
  snprintf(msg, msg_len, "ort_triton %s (%s): %s", op->name, type_name(op->type), detail);
}

static OrtStatus *op_status(const OrtApi *api, OrtErrorCode code, const ot_op *op, const char *detail) {
  char msg[OT_MSG_LEN + 64];
  prefix_message(op, detail, msg, sizeof msg);
  return api->CreateStatus(code, msg);
}

/* An ORT API call failed: keep its message, add the prefix and what we were doing. */
static OrtStatus *api_status(const OrtApi *api, const ot_op *op, OrtStatus *failed, const char *doing) {
  char detail[OT_MSG_LEN];
  snprintf(detail, sizeof detail, "%s: %s", doing, api->GetErrorMessage(failed));
  OrtErrorCode code = api->GetErrorCode(failed);
  api->ReleaseStatus(failed);
  return op_status(api, code, op, detail);
}

/* Returns from the calling function (which has `api` and `op` in scope) when an ORT call fails. */
#define TRY(call, doing)                                     \
  do {                                                       \
    OrtStatus *failed_ = (call);                             \
    if (failed_) return api_status(api, op, failed_, doing); \
  } while (0)

static int rank_error(const ot_op *op, int input, size_t rank, char *err, size_t err_len) {
  snprintf(err, err_len, "input %s has rank %zu; ort_triton supports at most 8 dimensions", op->inputs[input].name,
           rank);
  return 1;
}

/* The checks every op shares (inputs present when required, element types, output count), then the
 * op's own planner. in[] has op->n_inputs entries. */
static int plan_node(const ot_op *op, const ot_desc *in, int n_outputs, const double *attrs, int arch, ot_plan *plan,
                     char *err, size_t err_len) {
  for (int i = 0; i < op->n_inputs; i++) {
    if (!in[i].present && !op->inputs[i].optional) {
      snprintf(err, err_len, "required input %s is missing", op->inputs[i].name);
      return 1;
    }
    if (in[i].present && in[i].type != op->inputs[i].type) {
      snprintf(err, err_len, "input %s has element type %s; this op takes %s there", op->inputs[i].name,
               type_name(in[i].type), type_name(op->inputs[i].type));
      return 1;
    }
  }
  int required_outputs = 0;
  for (int o = 0; o < op->n_outputs; o++)
    if (!op->outputs[o].optional) required_outputs = o + 1;
  if (n_outputs < required_outputs || n_outputs > op->n_outputs) {
    if (required_outputs == op->n_outputs)
      snprintf(err, err_len, "the node has %d outputs; this op has %d", n_outputs, op->n_outputs);
    else
      snprintf(err, err_len, "the node has %d outputs; this op has %d to %d", n_outputs, required_outputs,
               op->n_outputs);
    return 1;
  }
  memset(plan, 0, sizeof *plan);
  plan->arch = arch;
  return op->plan(op, in, op->n_inputs, n_outputs, attrs, plan, err, err_len);
}

/* ---- kernel ---- */

static OrtStatus *ORT_API_CALL kernel_create(const OrtCustomOp *base, const OrtApi *api, const OrtKernelInfo *info,
                                             void **out) {
  const ot_op *op = table_op(base);
  ot_kernel k = {.api = api, .op = op};
  for (int a = 0; a < op->n_attrs; a++) {
    const ot_attr *attr = &op->attrs[a];
    float f = 0;
    int64_t i = 0;
    OrtStatus *missing = attr->kind == OT_ATTR_FLOAT ? api->KernelInfoGetAttribute_float(info, attr->name, &f)
                                                     : api->KernelInfoGetAttribute_int64(info, attr->name, &i);
    if (missing) {
      api->ReleaseStatus(missing);
      k.attrs[a] = attr->default_value;
    } else {
      k.attrs[a] = attr->kind == OT_ATTR_FLOAT ? (double)f : (double)i;
    }
  }

  /* An optional output may be written as "" in the node; ORT still counts it, but gives no tensor
   * for it, so the planner must not see it (AddLayerNorm would pick the kernel that stores sum). */
  size_t n_outputs = 0;
  TRY(api->KernelInfo_GetOutputCount(info, &n_outputs), "reading the node's output count");
  while (n_outputs > 0) {
    size_t name_size = 0;
    TRY(api->KernelInfo_GetOutputName(info, n_outputs - 1, NULL, &name_size), "reading the node's output names");
    if (name_size > 1) break; /* the size counts the terminating NUL */
    n_outputs--;
  }
  k.n_outputs = (int)n_outputs;

  ot_kernel *state = malloc(sizeof *state);
  if (!state) return op_status(api, ORT_FAIL, op, "out of host memory creating the kernel");
  *state = k;
  if (pthread_mutex_init(&state->lock, NULL)) {
    free(state);
    return op_status(api, ORT_FAIL, op, "could not create the kernel's lock");
  }
  *out = state;
  return NULL;
}

static void ORT_API_CALL kernel_destroy(void *state) {
  ot_kernel *k = state;
  for (ot_counters *c = k->counters, *next; c; c = next) {
    next = c->next;
    ot_cuda_counters_free(c->ctx, c->ptr);
    free(c);
  }
  pthread_mutex_destroy(&k->lock);
  free(k);
}

/* The node's merge counters on stream (OT_MERGE_COUNTERS zeroed int32; each launch that uses them leaves them
 * zeroed, and launches on one stream run in order), made at the node's first run on that stream; NULL when none
 * can be made now (inside a CUDA-graph capture, or the allocation failed): the plan then keeps its two launches. */
static void *merge_counters(ot_kernel *k, void *stream) {
  pthread_mutex_lock(&k->lock);
  ot_counters *c = k->counters;
  while (c && c->stream != stream) c = c->next;
  void *ptr = c ? c->ptr : NULL;
  if (!c) {
    char err[OT_MSG_LEN];
    ot_counters *fresh = malloc(sizeof *fresh);
    if (fresh && ot_cuda_counters(stream, OT_MERGE_COUNTERS, &fresh->ctx, &fresh->ptr, err, sizeof err) == 0) {
      fresh->stream = stream;
      fresh->next = k->counters;
      k->counters = fresh;
      ptr = fresh->ptr;
    } else {
      free(fresh);
    }
  }
  pthread_mutex_unlock(&k->lock);
  return ptr;
}

/* Type and shape of one input, or a status. */
static OrtStatus *describe(const OrtApi *api, const ot_op *op, int index, const OrtValue *value, ot_desc *d) {
  OrtTensorTypeAndShapeInfo *info;
  TRY(api->GetTensorTypeAndShape(value, &info), "reading an input's type and shape");
  OrtStatus *failed = api->GetTensorElementType(info, &d->type);
  if (!failed) failed = api->GetDimensionsCount(info, &d->rank);
  if (!failed && d->rank <= 8) failed = api->GetDimensions(info, d->dims, d->rank);
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (failed) return api_status(api, op, failed, "reading an input's type and shape");
  if (d->rank > 8) {
    char err[OT_MSG_LEN];
    rank_error(op, index, d->rank, err, sizeof err);
    return op_status(api, ORT_INVALID_ARGUMENT, op, err);
  }
  d->present = 1;
  return NULL;
}

/* The plan's GEMMs (those with m > 0, in order) through cuBLAS on ORT's handle for this stream. */
static OrtStatus *run_gemms(const OrtApi *api, const ot_op *op, OrtKernelContext *context, void *stream,
                            const ot_plan *plan, void *const *ptrs) {
  char err[OT_MSG_LEN];
  void *handle = NULL;
  TRY(api->KernelContext_GetResource(context, OT_ORT_CUDA_RESOURCE_VERSION, OT_ORT_CUBLAS_HANDLE, &handle),
      "getting ORT's cuBLAS handle");
  if (!handle) return op_status(api, ORT_FAIL, op, "ORT gave no cuBLAS handle for this node's stream");
  for (int g = 0; g < OT_MAX_GEMMS; g++)
    if (plan->gemms[g].m && ot_cublas_gemm(handle, stream, op->type, &plan->gemms[g], ptrs, err, sizeof err))
      return op_status(api, ORT_FAIL, op, err);
  return NULL;
}

/* Programs of a grid (the plan checked each axis fits). */
static size_t grid_programs(const unsigned grid[3]) { return (size_t)grid[0] * grid[1] * grid[2]; }

/* Triton's global scratch for a plan's launches (0 for kernels that need none): the largest a program over the
 * spec's images, whichever arch runs, times the larger grid; SIZE_MAX when that overflows. */
static size_t triton_scratch_bytes(const ot_plan *plan) {
  size_t each = 0;
  for (int i = 0; i < plan->spec->n_images; i++)
    if (plan->spec->images[i].global_scratch > each) each = plan->spec->images[i].global_scratch;
  size_t programs = grid_programs(plan->grid);
  if (plan->n_launches > 1 && grid_programs(plan->grid2) > programs) programs = grid_programs(plan->grid2);
  if (each && programs > SIZE_MAX / each) return SIZE_MAX;
  return each * programs;
}

/* Gives a workspace back to ORT's arena; NULL or the failed call's status. */
static OrtStatus *allocator_free(const OrtApi *api, OrtKernelContext *context, const OrtMemoryInfo *memory,
                                 void *block) {
  OrtAllocator *allocator = NULL;
  OrtStatus *failed = api->KernelContext_GetAllocator(context, memory, &allocator);
  if (failed) return failed;
  allocator->Free(allocator, block);
  api->ReleaseAllocator(allocator);
  return NULL;
}

static OrtStatus *ORT_API_CALL kernel_compute(void *state, OrtKernelContext *context) {
  ot_kernel *k = state;
  const OrtApi *api = k->api;
  const ot_op *op = k->op;
  char err[OT_MSG_LEN];

  void *stream = NULL;
  TRY(api->KernelContext_GetGPUComputeStream(context, &stream), "getting the CUDA stream");

  ot_desc in[OT_MAX_IO] = {{0}};
  void *ptrs[OT_PTR_WS + OT_MAX_WS] = {0}; /* inputs, then outputs, then the plan's workspace regions */
  size_t n_given = 0;
  TRY(api->KernelContext_GetInputCount(context, &n_given), "reading the input count");
  for (int i = 0; i < op->n_inputs && (size_t)i < n_given; i++) {
    const OrtValue *value = NULL;
    TRY(api->KernelContext_GetInput(context, (size_t)i, &value), "reading an input");
    if (!value) continue; /* an absent optional input */
    OrtStatus *failed = describe(api, op, i, value, &in[i]);
    if (failed) return failed;
    /* The ORT API has no const variant; inputs are only read. */
    TRY(api->GetTensorMutableData((OrtValue *)value, &ptrs[i]), "reading an input's data");
  }

  ot_plan plan;
  /* Specs tuned for one arch are picked by the GPU of ORT's stream (a few driver queries, so only for ops
   * that have them); without a usable driver, plan for any arch: the launch then says what is missing. */
  int arch = 0;
  if (op->n_tuned && ot_cuda_stream_arch(stream, &arch)) arch = 0;
  if (plan_node(op, in, k->n_outputs, k->attrs, arch, &plan, err, sizeof err))
    return op_status(api, ORT_INVALID_ARGUMENT, op, err);

  OrtValue *first_output = NULL; /* its memory info names the device a workspace goes on */
  for (int o = 0; o < k->n_outputs; o++) {
    OrtValue *value = NULL;
    TRY(api->KernelContext_GetOutput(context, (size_t)o, plan.outputs[o].dims, plan.outputs[o].rank, &value),
        "allocating an output");
    if (!value) {
      snprintf(err, sizeof err, "output %s is unnamed in the node but a later output is used; name it",
               op->outputs[o].name);
      return op_status(api, ORT_INVALID_ARGUMENT, op, err);
    }
    TRY(api->GetTensorMutableData(value, &ptrs[op->n_inputs + o]), "reading an output's data");
    if (o == 0) first_output = value;
  }
  if (plan.gemms[0].m && !plan.spec) { /* cuBLAS runs the node, on ORT's handle for this stream */
    OrtStatus *status = run_gemms(api, op, context, stream, &plan, ptrs);
    if (!status) atomic_fetch_add_explicit(&launches, 1, memory_order_relaxed);
    return status;
  }
  /* Empty tensors: the outputs exist (allocated above) and there is nothing to compute. */
  if (plan.grid[0] == 0 || plan.grid[1] == 0 || plan.grid[2] == 0) return NULL;
  /* The build compiles every kernel with Triton's divisible-by-16 hint on its pointers (for vector
   * loads); ORT's allocations satisfy it, but a misaligned tensor would fault, so refuse it here. */
  for (int i = 0; i < op->n_inputs + k->n_outputs; i++) {
    if ((uintptr_t)ptrs[i] % 16 == 0) continue;
    snprintf(err, sizeof err, "the data of %s %s is not 16-byte aligned, which the kernels assume; run this "
             "node without the ort_triton library",
             i < op->n_inputs ? "input" : "output",
             i < op->n_inputs ? op->inputs[i].name : op->outputs[i - op->n_inputs].name);
    return op_status(api, ORT_INVALID_ARGUMENT, op, err);
  }

  /* Outputs bound over their inputs (a cache's present over its past): the programs that would copy them stay
   * unlaunched (each would find the pointers equal and return). */
  if (plan.alias_grid0) {
    int aliased = plan.n_alias > 0;
    for (int j = 0; j < plan.n_alias; j++) aliased &= ptrs[op->n_inputs + plan.alias_out[j]] == ptrs[plan.alias_in[j]];
    if (aliased) plan.grid[0] = plan.alias_grid0;
  }

  /* Two launches that can run as one over the node's merge counters on this stream, where it has them. */
  if (plan.merge_counters) { /* the planner offers it for two launches and at most OT_MERGE_COUNTERS */
    plan.counters = merge_counters(k, stream);
    if (plan.counters) plan.n_launches = 1;
  }

  /* A workspace (a split's chunk states) from ORT's arena on the outputs' device, stream-ordered: it goes
   * back to the arena once both launches are enqueued, and the next kernel on the stream that reuses it runs
   * after them. Triton's global scratch (device-made TMA descriptors, a slice a program) comes the same way,
   * after the workspace: sized for the larger grid and the largest image of the spec, whichever arch runs. */
  const size_t global_scratch = triton_scratch_bytes(&plan);
  const size_t workspace = (plan.scratch_bytes + 255) / 256 * 256; /* the global scratch starts aligned */
  if (global_scratch > SIZE_MAX - workspace) {
    snprintf(err, sizeof err, "grid %u x %u x %u needs more Triton scratch than memory can address", plan.grid[0],
             plan.grid[1], plan.grid[2]);
    return op_status(api, ORT_INVALID_ARGUMENT, op, err);
  }
  const size_t total = workspace + global_scratch;
  const OrtMemoryInfo *device_memory = NULL;
  void *block = NULL;
  if (total) {
    TRY(api->GetTensorMemoryInfo(first_output, &device_memory), "reading the output's device");
    TRY(api->KernelContext_GetScratchBuffer(context, device_memory, total, &block), "allocating the workspace");
    if (!block) {
      snprintf(err, sizeof err, "ORT gave no workspace of %zu bytes", total);
      return op_status(api, ORT_FAIL, op, err);
    }
    if (global_scratch && (uintptr_t)block % 256) { /* the AOT build took scratch aligned to a divisor of 256 */
      snprintf(err, sizeof err, "ORT's workspace of %zu bytes is not 256-byte aligned", total);
      OrtStatus *failed = allocator_free(api, context, device_memory, block);
      if (failed) api->ReleaseStatus(failed);
      return op_status(api, ORT_FAIL, op, err);
    }
    if (plan.scratch_bytes) plan.scratch = block;
  }
  for (int j = 0; j < OT_MAX_WS && plan.scratch; j++) ptrs[OT_PTR_WS + j] = (char *)plan.scratch + plan.ws_offsets[j];
  void *triton_scratch = global_scratch ? (char *)block + workspace : NULL;
  OrtStatus *status = NULL;
  const int n_launches = plan.n_launches > 1 ? plan.n_launches : 1;
  for (int l = 0; l < n_launches && !status; l++) {
    plan.launch = l;
    uint64_t storage[OT_MAX_PARAMS];
    void *params[OT_MAX_PARAMS];
    int n = op->params(op, &plan, in, ptrs, k->attrs, storage, params);
    if (n < 0 || n + 2 > OT_MAX_PARAMS) {
      snprintf(err, sizeof err, "the op's C code produced %d kernel parameters (at most %d); rebuild the library",
               n, OT_MAX_PARAMS - 2);
      status = op_status(api, ORT_FAIL, op, err);
      break;
    }
    /* Triton 3.6 kernels end with two pointers, global scratch and profile scratch; no kernel here uses
     * the second. */
    void *scratch[2] = {triton_scratch, NULL};
    params[n] = &scratch[0];
    params[n + 1] = &scratch[1];
    if (ot_cuda_launch(plan.spec, l ? plan.grid2 : plan.grid, stream, params, err, sizeof err))
      status = op_status(api, ORT_FAIL, op, err);
    if (!status && l == 0 && plan.gemms[0].m) status = run_gemms(api, op, context, stream, &plan, ptrs);
  }
  if (block) {
    OrtStatus *failed = allocator_free(api, context, device_memory, block);
    if (failed && !status) {
      status = api_status(api, op, failed, "returning the workspace");
    } else if (failed) {
      api->ReleaseStatus(failed);
    }
  }
  if (!status) atomic_fetch_add_explicit(&launches, 1, memory_order_relaxed);
  return status;
}

/* ---- OrtCustomOp callbacks ---- */

static const char *ORT_API_CALL op_name(const OrtCustomOp *base) { return table_op(base)->name; }
static const char *ORT_API_CALL op_provider(const OrtCustomOp *base) {
  (void)base;
  return "CUDAExecutionProvider";
}
static size_t ORT_API_CALL op_input_count(const OrtCustomOp *base) { return (size_t)table_op(base)->n_inputs; }
static size_t ORT_API_CALL op_output_count(const OrtCustomOp *base) { return (size_t)table_op(base)->n_outputs; }
static ONNXTensorElementDataType ORT_API_CALL op_input_type(const OrtCustomOp *base, size_t i) {
  return table_op(base)->inputs[i].type;
}
static ONNXTensorElementDataType ORT_API_CALL op_output_type(const OrtCustomOp *base, size_t i) {
  return table_op(base)->outputs[i].type;
}
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL op_input_characteristic(const OrtCustomOp *base, size_t i) {
  return table_op(base)->inputs[i].optional ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL op_output_characteristic(const OrtCustomOp *base, size_t i) {
  return table_op(base)->outputs[i].optional ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}
static OrtMemType ORT_API_CALL op_input_memory(const OrtCustomOp *base, size_t i) {
  (void)base;
  (void)i;
  return OrtMemTypeDefault; /* device memory: the kernels read inputs on the GPU */
}
/* No op has variadic inputs or outputs; ORT only asks these for variadic ones. */
static int ORT_API_CALL op_variadic_min_arity(const OrtCustomOp *base) {
  (void)base;
  return 1;
}
static int ORT_API_CALL op_variadic_homogeneous(const OrtCustomOp *base) {
  (void)base;
  return 1;
}
static int ORT_API_CALL op_start_version(const OrtCustomOp *base) {
  (void)base;
  return 1;
}
static int ORT_API_CALL op_end_version(const OrtCustomOp *base) {
  (void)base;
  return INT_MAX;
}

/* ---- registration ---- */

/* ORT keeps pointers to the ops and domains for as long as sessions made from the options live, which
 * this library cannot know; so they are built once and never freed. */
static pthread_once_t ops_once = PTHREAD_ONCE_INIT;
static ot_custom_op *custom_ops;

static void build_custom_ops(void) {
  ot_custom_op *ops = calloc((size_t)ot_n_ops, sizeof *ops);
  if (!ops) return;
  for (int i = 0; i < ot_n_ops; i++) {
    OrtCustomOp *c = &ops[i].base;
    ops[i].op = &ot_ops[i];
    c->version = ORT_API_VERSION;
    c->GetName = op_name;
    c->GetExecutionProviderType = op_provider;
    c->GetInputType = op_input_type;
    c->GetInputTypeCount = op_input_count;
    c->GetOutputType = op_output_type;
    c->GetOutputTypeCount = op_output_count;
    c->KernelDestroy = kernel_destroy;
    c->GetInputCharacteristic = op_input_characteristic;
    c->GetOutputCharacteristic = op_output_characteristic;
    c->GetInputMemoryType = op_input_memory;
    c->GetVariadicInputMinArity = op_variadic_min_arity;
    c->GetVariadicInputHomogeneity = op_variadic_homogeneous;
    c->GetVariadicOutputMinArity = op_variadic_min_arity;
    c->GetVariadicOutputHomogeneity = op_variadic_homogeneous;
    c->CreateKernelV2 = kernel_create;
    c->KernelComputeV2 = kernel_compute;
    c->GetStartVersion = op_start_version;
    c->GetEndVersion = op_end_version;
    /* calloc left CreateKernel, KernelCompute, InferOutputShapeFn and the inplace/alias maps NULL. */
  }
  custom_ops = ops;
}

/* One domain per RegisterCustomOps call, kept reachable here (never released, see above). */
typedef struct ot_domain_node {
  OrtCustomOpDomain *domain;
  struct ot_domain_node *next;
} ot_domain_node;
static pthread_mutex_t domains_lock = PTHREAD_MUTEX_INITIALIZER;
static ot_domain_node *domains;

static OrtStatus *registration_status(const OrtApi *api, OrtStatus *failed, const char *doing) {
  char msg[OT_MSG_LEN];
  snprintf(msg, sizeof msg, "ort_triton: %s: %s", doing, api->GetErrorMessage(failed));
  api->ReleaseStatus(failed);
  return api->CreateStatus(ORT_FAIL, msg);
}

OT_EXPORT OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *api_base) {
  const OrtApi *api = api_base->GetApi(ORT_API_VERSION);
  if (!api) {
    /* Version 1 of the API exists in every ORT and is enough to say why we stop. If even that is
     * missing there is no way to report an error. */
    const OrtApi *old = api_base->GetApi(1);
    char msg[256];
    snprintf(msg, sizeof msg, "ort_triton: onnxruntime %s is too old; this library needs onnxruntime >= 1.21",
             api_base->GetVersionString());
    return old ? old->CreateStatus(ORT_FAIL, msg) : NULL;
  }

  pthread_once(&ops_once, build_custom_ops);
  if (!custom_ops) return api->CreateStatus(ORT_FAIL, "ort_triton: out of host memory registering the ops");

  ot_domain_node *node = malloc(sizeof *node);
  if (!node) return api->CreateStatus(ORT_FAIL, "ort_triton: out of host memory registering the ops");
  OrtStatus *failed = api->CreateCustomOpDomain(ot_domain, &node->domain);
  if (failed) {
    free(node);
    return registration_status(api, failed, "creating the custom op domain");
  }
  /* From here the domain is kept even on failure: ORT may already refer to it. */
  pthread_mutex_lock(&domains_lock);
  node->next = domains;
  domains = node;
  pthread_mutex_unlock(&domains_lock);

  for (int i = 0; i < ot_n_ops && !failed; i++) failed = api->CustomOpDomain_Add(node->domain, &custom_ops[i].base);
  if (failed) return registration_status(api, failed, "adding an op to the domain");
  failed = api->AddCustomOpDomain(options, node->domain);
  if (failed) return registration_status(api, failed, "adding the domain to the session options");
  return NULL;
}

/* ---- test hooks: plans and table contents, without a GPU ---- */

static const ot_op *find_op(const char *name, int elem_type, char *msg, size_t msg_len) {
  char types[128] = "";
  size_t used = 0;
  for (int i = 0; i < ot_n_ops; i++) {
    if (strcmp(ot_ops[i].name, name) != 0) continue;
    if ((int)ot_ops[i].type == elem_type) return &ot_ops[i];
    if (used < sizeof types)
      used += (size_t)snprintf(types + used, sizeof types - used, "%s%s", used ? ", " : "", type_name(ot_ops[i].type));
  }
  if (used) {
    snprintf(msg, msg_len, "ort_triton %s (%s): element type %s is not supported; this op takes %s", name,
             type_name((ONNXTensorElementDataType)elem_type), type_name((ONNXTensorElementDataType)elem_type), types);
    return NULL;
  }
  char names[512] = "";
  used = 0;
  for (int i = 0; i < ot_n_ops && used < sizeof names; i++) {
    int seen = 0;
    for (int j = 0; j < i && !seen; j++) seen = strcmp(ot_ops[j].name, ot_ops[i].name) == 0;
    if (!seen) used += (size_t)snprintf(names + used, sizeof names - used, "%s%s", used ? ", " : "", ot_ops[i].name);
  }
  snprintf(msg, msg_len, "ort_triton: unknown op %s; this library has %s", name, used ? names : "no ops");
  return NULL;
}

/* " out<i>=<shape>" for each output, the shapes the node will get, after the `used` bytes of msg. */
static void append_outputs(const ot_plan *plan, int n_outputs, int used, char *msg, size_t msg_len) {
  for (int i = 0; i < n_outputs && used > 0 && (size_t)used < msg_len; i++) {
    char shape[160];
    used += snprintf(msg + used, msg_len - (size_t)used, " out%d=%s", i,
                     ot_shape_text(&plan->outputs[i], shape, sizeof shape));
  }
}

/* "cublasGemmEx m=.. n=.. k=.. trans=.. ld=..,..,.. ptrs=a,b,c" after the `used` bytes of msg; returns the new length. */
static int append_gemm(const ot_gemm *g, int used, char *msg, size_t msg_len) {
  if (used <= 0 || (size_t)used >= msg_len) return used;
  return used + snprintf(msg + used, msg_len - (size_t)used,
                         "cublasGemmEx m=%lld n=%lld k=%lld trans=%d%d ld=%lld,%lld,%lld ptrs=%d,%d,%d",
                         (long long)g->m, (long long)g->n, (long long)g->k, g->trans_a, g->trans_b, (long long)g->lda,
                         (long long)g->ldb, (long long)g->ldc, g->a, g->b, g->c);
}

/* Plans a node as compute would and picks the image for arch. present[] and ranks[] have n_inputs
 * entries (ranks of absent inputs are ignored); dims_flat concatenates the dims of the present
 * inputs; types[] (NULL: every input of the type the op declares there, elem_type but for inputs of a
 * fixed type such as EmbedLayerNorm's int64 ids) gives each input's element type; attrs holds the first
 * n_attrs attribute values in contract order (the rest take their defaults). Returns 0 with
 * "kernel=<name> arch=<image arch> grid=<x>,<y>,<z> block=<threads> shared=<bytes>" in msg, or an
 * OrtErrorCode (ORT_INVALID_ARGUMENT, ORT_FAIL) with the message compute would return. */
static int plan_hook(const char *op_name, int elem_type, int arch, int n_inputs, const int *present, const int *types,
                     const int *ranks, const int64_t *dims_flat, int n_outputs, int n_attrs, const double *attrs,
                     char *msg, size_t msg_len) {
  const ot_op *op = find_op(op_name, elem_type, msg, msg_len);
  if (!op) return ORT_INVALID_ARGUMENT;
  char err[OT_MSG_LEN];
  double values[OT_MAX_ATTRS];
  for (int a = 0; a < op->n_attrs; a++) values[a] = a < n_attrs ? attrs[a] : op->attrs[a].default_value;
  if (n_inputs < 0 || n_inputs > op->n_inputs) {
    snprintf(err, sizeof err, "the node has %d inputs; this op has at most %d", n_inputs, op->n_inputs);
    prefix_message(op, err, msg, msg_len);
    return ORT_INVALID_ARGUMENT;
  }
  ot_desc in[OT_MAX_IO] = {{0}};
  for (int i = 0; i < n_inputs; i++) {
    if (!present[i]) continue;
    if (ranks[i] < 0 || ranks[i] > 8) {
      rank_error(op, i, (size_t)(ranks[i] < 0 ? 0 : ranks[i]), err, sizeof err);
      prefix_message(op, err, msg, msg_len);
      return ORT_INVALID_ARGUMENT;
    }
    in[i] = (ot_desc){.present = 1, .type = types ? (ONNXTensorElementDataType)types[i] : op->inputs[i].type,
                      .rank = (size_t)ranks[i]};
    memcpy(in[i].dims, dims_flat, (size_t)ranks[i] * sizeof *dims_flat);
    dims_flat += ranks[i];
  }

  ot_plan plan;
  if (plan_node(op, in, n_outputs, values, arch, &plan, err, sizeof err)) {
    prefix_message(op, err, msg, msg_len);
    return ORT_INVALID_ARGUMENT;
  }
  if (plan.gemms[0].m && !plan.spec) { /* cuBLAS, no kernel of ours */
    int used = snprintf(msg, msg_len, "kernel=");
    used = append_gemm(&plan.gemms[0], used, msg, msg_len);
    append_outputs(&plan, n_outputs, used, msg, msg_len);
    return 0;
  }
  if (!plan.spec) { /* nothing to run (an empty output) */
    int used = snprintf(msg, msg_len, "kernel=none grid=%u,%u,%u", plan.grid[0], plan.grid[1], plan.grid[2]);
    append_outputs(&plan, n_outputs, used, msg, msg_len);
    return 0;
  }
  const ot_image *image = ot_pick_image(plan.spec, arch, err, sizeof err);
  if (!image) {
    prefix_message(op, err, msg, msg_len);
    return ORT_FAIL;
  }
  int used = snprintf(msg, msg_len, "kernel=%s arch=%d grid=%u,%u,%u block=%u shared=%u spec=%d",
                      plan.spec->kernel_name, image->arch, plan.grid[0], plan.grid[1], plan.grid[2],
                      32u * image->num_warps, image->shared_bytes, (int)(plan.spec - op->specs));
  /* a plan with GEMMs runs them after launch 0: " then=cublasGemmEx ..." for each, before grid2 */
  for (int g = 0; g < OT_MAX_GEMMS; g++) {
    if (!plan.gemms[g].m || used <= 0 || (size_t)used >= msg_len) continue;
    used += snprintf(msg + used, msg_len - (size_t)used, " then=");
    used = append_gemm(&plan.gemms[g], used, msg, msg_len);
  }
  if (plan.n_launches > 1 && used > 0 && (size_t)used < msg_len)
    used += snprintf(msg + used, msg_len - (size_t)used, " grid2=%u,%u,%u", plan.grid2[0], plan.grid2[1],
                     plan.grid2[2]);
  if (plan.scratch_bytes && used > 0 && (size_t)used < msg_len)
    used += snprintf(msg + used, msg_len - (size_t)used, " scratch=%zu", plan.scratch_bytes);
  if (plan.merge_counters && used > 0 && (size_t)used < msg_len) /* one launch where compute has the counters */
    used += snprintf(msg + used, msg_len - (size_t)used, " merge_counters=%zu", plan.merge_counters);
  if (plan.alias_grid0 && used > 0 && (size_t)used < msg_len) /* the grid when outputs are bound over inputs */
    used += snprintf(msg + used, msg_len - (size_t)used, " alias_grid=%u", plan.alias_grid0);
  const size_t triton_scratch = triton_scratch_bytes(&plan);
  if (triton_scratch && used > 0 && (size_t)used < msg_len)
    used += snprintf(msg + used, msg_len - (size_t)used, " triton_scratch=%zu", triton_scratch);
  append_outputs(&plan, n_outputs, used, msg, msg_len);
  return 0;
}

/* plan_hook with each input of its declared type. */
OT_EXPORT int ort_triton_plan_attrs(const char *op_name, int elem_type, int arch, int n_inputs, const int *present,
                                    const int *ranks, const int64_t *dims_flat, int n_outputs, int n_attrs,
                                    const double *attrs, char *msg, size_t msg_len) {
  return plan_hook(op_name, elem_type, arch, n_inputs, present, NULL, ranks, dims_flat, n_outputs, n_attrs, attrs, msg,
                   msg_len);
}

/* ort_triton_plan_attrs with every attribute at its default. */
OT_EXPORT int ort_triton_plan(const char *op_name, int elem_type, int arch, int n_inputs, const int *present,
                              const int *ranks, const int64_t *dims_flat, int n_outputs, char *msg, size_t msg_len) {
  return plan_hook(op_name, elem_type, arch, n_inputs, present, NULL, ranks, dims_flat, n_outputs, 0, NULL, msg,
                   msg_len);
}

/* plan_hook with the given element type of each input (ONNXTensorElementDataType values) and every attribute
 * at its default: lets tests give an input a type the op does not take there. */
OT_EXPORT int ort_triton_plan_types(const char *op_name, int elem_type, int arch, int n_inputs, const int *present,
                                    const int *types, const int *ranks, const int64_t *dims_flat, int n_outputs,
                                    char *msg, size_t msg_len) {
  return plan_hook(op_name, elem_type, arch, n_inputs, present, types, ranks, dims_flat, n_outputs, 0, NULL, msg,
                   msg_len);
}

/* "kernel=<name> keys=<min>:<max>,... archs=<arch>,..." for spec s of op i: lets tests see which
 * specialisation a plan picked. Returns 0, or nonzero for indices out of range. */
OT_EXPORT int ort_triton_spec_info(int i, int s, char *msg, size_t msg_len) {
  if (i < 0 || i >= ot_n_ops || s < 0 || s >= ot_ops[i].n_specs) return 1;
  const ot_spec *spec = &ot_ops[i].specs[s];
  size_t used = (size_t)snprintf(msg, msg_len, "kernel=%s keys=", spec->kernel_name);
  for (int k = 0; k < spec->n_keys && used < msg_len; k++)
    used += (size_t)snprintf(msg + used, msg_len - used, "%s%lld:%lld", k ? "," : "", (long long)spec->key_min[k],
                             (long long)spec->key_max[k]);
  for (int a = 0; a < spec->n_images && used < msg_len; a++)
    used += (size_t)snprintf(msg + used, msg_len - used, "%s%d", a ? "," : " archs=", spec->images[a].arch);
  return 0;
}

OT_EXPORT const char *ort_triton_build_info(void) { return ot_build_info; }
OT_EXPORT int ort_triton_num_ops(void) { return ot_n_ops; }
OT_EXPORT const char *ort_triton_op_name(int i) { return i >= 0 && i < ot_n_ops ? ot_ops[i].name : NULL; }
OT_EXPORT int ort_triton_op_type(int i) { return i >= 0 && i < ot_n_ops ? (int)ot_ops[i].type : 0; }
OT_EXPORT int ort_triton_num_specs(int i) { return i >= 0 && i < ot_n_ops ? ot_ops[i].n_specs : 0; }
OT_EXPORT long ort_triton_launches(void) { return atomic_load_explicit(&launches, memory_order_relaxed); }
/* Of those, the ones launched with programmatic dependent launch (ORT_TRITON_PDL=1 and a PDL image). */
OT_EXPORT long ort_triton_pdl_launches(void) { return ot_cuda_pdl_launches(); }
/* 0 when the CUDA driver can be used, else 1 with the message a kernel launch would return; lets tests
 * on machines without a GPU check that message. */
OT_EXPORT int ort_triton_driver_status(char *msg, size_t msg_len) { return ot_cuda_driver_status(msg, msg_len); }
