/* cuda_driver.c: the CUDA driver, opened lazily with dlopen, and a per-context module cache.
 * The few driver types are declared here instead of including cuda.h so that the library builds
 * without the CUDA toolkit; their layout is fixed by the driver ABI. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_driver.h"

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;

enum {
  CUDA_SUCCESS = 0,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
  CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
};

/* cuLaunchKernelEx's configuration (CUDA 12.0 on), for programmatic dependent launch: a kernel whose image says
 * pdl may start while the kernel before it in the stream finishes, and runs griddepcontrol.wait before it touches
 * what that kernel writes (contract.Kernel.pdl). Layouts as in cuda.h: the attribute value is a 64-byte union. */
enum { CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6 };
typedef struct {
  int id;
  char pad[8 - sizeof(int)];
  union {
    char pad[64];
    int programmatic_stream_serialization_allowed;
  } value;
} CUlaunchAttribute;
typedef struct {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  CUstream stream;
  CUlaunchAttribute *attrs;
  unsigned num_attrs;
} CUlaunchConfig;
typedef CUresult (*cu_launch_kernel_ex)(const CUlaunchConfig *config, CUfunction fn, void **params, void **extra);

/* Launches with more dynamic shared memory than this must opt in per function. */
#define OT_DEFAULT_SHARED_LIMIT (48u * 1024u)

/* Fields carry the exported symbol names (the _v2 ones are what cuda.h maps the plain names to). */
static struct cu_api {
  CUresult (*cuInit)(unsigned flags);
  CUresult (*cuGetErrorString)(CUresult error, const char **str);
  CUresult (*cuCtxGetCurrent)(CUcontext *ctx);
  CUresult (*cuStreamGetCtx)(CUstream stream, CUcontext *ctx);
  CUresult (*cuCtxPushCurrent_v2)(CUcontext ctx);
  CUresult (*cuCtxPopCurrent_v2)(CUcontext *ctx);
  CUresult (*cuCtxGetDevice)(CUdevice *device);
  CUresult (*cuDeviceGetAttribute)(int *value, int attribute, CUdevice device);
  CUresult (*cuModuleLoadData)(CUmodule *module, const void *image);
  CUresult (*cuModuleUnload)(CUmodule module);
  CUresult (*cuModuleGetFunction)(CUfunction *fn, CUmodule module, const char *name);
  CUresult (*cuFuncSetAttribute)(CUfunction fn, int attribute, int value);
  CUresult (*cuLaunchKernel)(CUfunction fn, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                             unsigned block_y, unsigned block_z, unsigned shared_bytes, CUstream stream,
                             void **params, void **extra);
  CUresult (*cuMemAlloc_v2)(CUdeviceptr *ptr, size_t bytes);
  CUresult (*cuMemFree_v2)(CUdeviceptr ptr);
  CUresult (*cuMemsetD32Async)(CUdeviceptr ptr, unsigned value, size_t n, CUstream stream);
  CUresult (*cuStreamIsCapturing)(CUstream stream, int *status); /* CUstreamCaptureStatus: 0 = not capturing */
} cu;

#define CU_SYMBOL(name) {#name, offsetof(struct cu_api, name)}
static const struct {
  const char *name;
  size_t offset;
} cu_symbols[] = {
    CU_SYMBOL(cuInit),           CU_SYMBOL(cuGetErrorString),    CU_SYMBOL(cuCtxGetCurrent),
    CU_SYMBOL(cuStreamGetCtx),   CU_SYMBOL(cuCtxPushCurrent_v2), CU_SYMBOL(cuCtxPopCurrent_v2),
    CU_SYMBOL(cuCtxGetDevice),   CU_SYMBOL(cuDeviceGetAttribute), CU_SYMBOL(cuModuleLoadData),
    CU_SYMBOL(cuModuleUnload),   CU_SYMBOL(cuModuleGetFunction), CU_SYMBOL(cuFuncSetAttribute),
    CU_SYMBOL(cuLaunchKernel),   CU_SYMBOL(cuMemAlloc_v2),       CU_SYMBOL(cuMemFree_v2),
    CU_SYMBOL(cuMemsetD32Async), CU_SYMBOL(cuStreamIsCapturing),
};

static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static char driver_error[512]; /* set once by load_driver; empty when the driver is usable */
/* cuLaunchKernelEx where the driver has it and ORT_TRITON_PDL=1 (set by load_driver: opt-in until a GPU run has timed
 * it in a model); NULL: every kernel launches with cuLaunchKernel, and griddepcontrol.wait returns at once. */
static cu_launch_kernel_ex launch_ex;
static atomic_long pdl_launches; /* launches with programmatic stream serialization, for tests */

long ot_cuda_pdl_launches(void) { return atomic_load_explicit(&pdl_launches, memory_order_relaxed); }

static void load_driver(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char *why = dlerror();
    snprintf(driver_error, sizeof driver_error,
             "CUDA driver libcuda.so.1 could not be loaded, %s; install the NVIDIA driver, or run the model "
             "without the ort_triton library: its function bodies run on stock ORT ops",
             why ? why : "unknown dlopen error");
    return;
  }
  /* The library is never closed: the resolved pointers are used for the life of the process. */
  for (size_t i = 0; i < sizeof cu_symbols / sizeof cu_symbols[0]; i++) {
    void *fn = dlsym(lib, cu_symbols[i].name);
    if (!fn) {
      snprintf(driver_error, sizeof driver_error,
               "CUDA driver libcuda.so.1 has no %s; it is too old, update the NVIDIA driver", cu_symbols[i].name);
      return;
    }
    memcpy((char *)&cu + cu_symbols[i].offset, &fn, sizeof fn); /* POSIX: data and function pointers agree */
  }
  const char *pdl = getenv("ORT_TRITON_PDL");
  if (pdl && strcmp(pdl, "1") == 0) {
    void *fn = dlsym(lib, "cuLaunchKernelEx");
    memcpy(&launch_ex, &fn, sizeof fn);
  }
  CUresult r = cu.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char *text = NULL;
    cu.cuGetErrorString(r, &text);
    snprintf(driver_error, sizeof driver_error, "cuInit failed: %s (CUDA error %d); check the NVIDIA driver and GPU",
             text ? text : "unknown error", r);
  }
}

int ot_cuda_driver_status(char *err, size_t err_len) {
  pthread_once(&driver_once, load_driver);
  if (!driver_error[0]) return 0;
  snprintf(err, err_len, "%s", driver_error);
  return 1;
}

/* Writes "<call> failed: <driver text> (CUDA error N)<hint>" and returns 1, so a failing call reads
 * `return cu_fail(...)`. */
static int cu_fail(CUresult r, const char *call, const char *hint, char *err, size_t err_len) {
  const char *text = NULL;
  if (cu.cuGetErrorString(r, &text) != CUDA_SUCCESS || !text) text = "unknown error";
  snprintf(err, err_len, "%s failed: %s (CUDA error %d)%s", call, text, r, hint);
  return 1;
}

/* Loaded functions, one per (context, image). An image belongs to exactly one (op, spec, arch), so this
 * key is the (context, op, spec, arch) of the module. Entries are never removed: contexts that ORT's
 * CUDA EP uses live as long as the process. */
typedef struct ot_module {
  CUcontext ctx;
  const ot_image *image;
  CUfunction fn;
  struct ot_module *next;
} ot_module;

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static ot_module *cache;

/* Loads image into ctx (the current context) once. The lock is held across the load so that two
 * threads never load the same module twice; loads happen once per (context, image), so the
 * serialisation costs nothing in steady state. */
static int get_function(CUcontext ctx, const ot_image *image, const char *kernel_name, CUfunction *fn, char *err,
                        size_t err_len) {
  pthread_mutex_lock(&cache_lock);
  for (const ot_module *m = cache; m; m = m->next) {
    if (m->ctx == ctx && m->image == image) {
      *fn = m->fn;
      pthread_mutex_unlock(&cache_lock);
      return 0;
    }
  }

  int rc = 0;
  CUmodule module = NULL;
  ot_module *entry = malloc(sizeof *entry);
  CUresult r;
  if (!entry) {
    snprintf(err, err_len, "out of host memory caching the kernel module");
    rc = 1;
  } else if ((r = cu.cuModuleLoadData(&module, image->image)) != CUDA_SUCCESS) {
    module = NULL;
    rc = cu_fail(r, "cuModuleLoadData", "; the cubin does not fit this GPU or driver, rebuild ort_triton for it",
                 err, err_len);
  } else if ((r = cu.cuModuleGetFunction(fn, module, kernel_name)) != CUDA_SUCCESS) {
    rc = cu_fail(r, "cuModuleGetFunction", "; the library's kernel table does not match its cubin", err, err_len);
  } else if (image->shared_bytes > OT_DEFAULT_SHARED_LIMIT &&
             (r = cu.cuFuncSetAttribute(*fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        (int)image->shared_bytes)) != CUDA_SUCCESS) {
    rc = cu_fail(r, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                 "; this GPU has less shared memory than the kernel was built for", err, err_len);
  }

  if (rc == 0) {
    *entry = (ot_module){ctx, image, *fn, cache};
    cache = entry;
  } else {
    free(entry);
    if (module) cu.cuModuleUnload(module); /* so that a failure repeated on every run leaks nothing */
  }
  pthread_mutex_unlock(&cache_lock);
  return rc;
}

/* 10 * major + minor of the current context's device. */
static int current_arch(int *arch, char *err, size_t err_len) {
  CUdevice dev;
  int major, minor;
  CUresult r = cu.cuCtxGetDevice(&dev);
  if (r != CUDA_SUCCESS) return cu_fail(r, "cuCtxGetDevice", "", err, err_len);
  if ((r = cu.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)) != CUDA_SUCCESS ||
      (r = cu.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)) != CUDA_SUCCESS)
    return cu_fail(r, "cuDeviceGetAttribute(COMPUTE_CAPABILITY)", "", err, err_len);
  *arch = 10 * major + minor;
  return 0;
}

/* The part of a launch that needs ctx current. */
static int launch_current(CUcontext ctx, const ot_spec *spec, const unsigned grid[3], CUstream stream,
                          void **params, char *err, size_t err_len) {
  int arch;
  if (current_arch(&arch, err, err_len)) return 1;
  const ot_image *image = ot_pick_image(spec, arch, err, err_len);
  if (!image) return 1;
  CUfunction fn;
  if (get_function(ctx, image, spec->kernel_name, &fn, err, err_len)) return 1;

  const unsigned block = 32u * image->num_warps;
  if (image->pdl && launch_ex) {
    CUlaunchAttribute attr;
    memset(&attr, 0, sizeof attr);
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmatic_stream_serialization_allowed = 1;
    const CUlaunchConfig config = {grid[0], grid[1], grid[2], block, 1, 1, image->shared_bytes, stream, &attr, 1};
    CUresult r = launch_ex(&config, fn, params, NULL);
    if (r != CUDA_SUCCESS) return cu_fail(r, "cuLaunchKernelEx", " (programmatic dependent launch: unset "
                                          "ORT_TRITON_PDL to launch without it)", err, err_len);
    atomic_fetch_add_explicit(&pdl_launches, 1, memory_order_relaxed);
    return 0;
  }
  CUresult r = cu.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block, 1, 1, image->shared_bytes, stream, params, NULL);
  if (r != CUDA_SUCCESS) return cu_fail(r, "cuLaunchKernel", "", err, err_len);
  return 0;
}

/* Makes ctx current for the calling thread, *previous the context it replaces (restored by leave_context). */
static int enter_context(CUcontext ctx, CUcontext *previous, char *err, size_t err_len) {
  CUresult r = cu.cuCtxGetCurrent(previous);
  if (r != CUDA_SUCCESS) return cu_fail(r, "cuCtxGetCurrent", "", err, err_len);
  if (*previous != ctx && (r = cu.cuCtxPushCurrent_v2(ctx)) != CUDA_SUCCESS)
    return cu_fail(r, "cuCtxPushCurrent", "", err, err_len);
  return 0;
}

/* Undoes enter_context(ctx, &previous). */
static int leave_context(CUcontext ctx, CUcontext previous, char *err, size_t err_len) {
  CUcontext popped;
  CUresult r;
  if (previous != ctx && (r = cu.cuCtxPopCurrent_v2(&popped)) != CUDA_SUCCESS)
    return cu_fail(r, "cuCtxPopCurrent", "", err, err_len);
  return 0;
}

/* enter_context for the context that owns stream (NULL: the current context). The stream's context, not the
 * calling thread's, decides the device: ORT may run this thread with another device's context current, or none. */
static int enter_stream_context(void *stream, CUcontext *ctx, CUcontext *previous, char *err, size_t err_len) {
  if (ot_cuda_driver_status(err, err_len)) return 1;
  *ctx = NULL;
  CUresult r = stream ? cu.cuStreamGetCtx((CUstream)stream, ctx) : cu.cuCtxGetCurrent(ctx);
  if (r != CUDA_SUCCESS) return cu_fail(r, stream ? "cuStreamGetCtx" : "cuCtxGetCurrent", "", err, err_len);
  if (!*ctx) {
    snprintf(err, err_len, "ORT gave no CUDA stream and no CUDA context is current; run the node on the "
                           "CUDAExecutionProvider");
    return 1;
  }
  return enter_context(*ctx, previous, err, err_len);
}

int ot_cuda_stream_arch(void *stream, int *arch) {
  char err[1024];
  CUcontext ctx, previous;
  if (enter_stream_context(stream, &ctx, &previous, err, sizeof err)) return 1;
  int rc = current_arch(arch, err, sizeof err);
  if (leave_context(ctx, previous, err, sizeof err)) rc = 1;
  return rc;
}

int ot_cuda_launch(const ot_spec *spec, const unsigned grid[3], void *stream, void **params, char *err,
                   size_t err_len) {
  CUcontext ctx, previous;
  if (enter_stream_context(stream, &ctx, &previous, err, err_len)) return 1;
  if (launch_current(ctx, spec, grid, (CUstream)stream, params, err, err_len)) {
    leave_context(ctx, previous, NULL, 0); /* the launch's error is the one to report */
    return 1;
  }
  return leave_context(ctx, previous, err, err_len);
}

int ot_cuda_counters(void *stream, size_t n, void **ctx_out, void **ptr_out, char *err, size_t err_len) {
  CUcontext ctx, previous;
  if (enter_stream_context(stream, &ctx, &previous, err, err_len)) return 1;
  int capturing = 0, rc = 0;
  CUdeviceptr ptr = 0;
  CUresult r = cu.cuStreamIsCapturing((CUstream)stream, &capturing);
  if (r != CUDA_SUCCESS) {
    rc = cu_fail(r, "cuStreamIsCapturing", "", err, err_len);
  } else if (capturing) { /* no allocation inside a capture: the caller keeps its plan without the buffer */
    snprintf(err, err_len, "the stream is capturing a CUDA graph");
    rc = 1;
  } else if ((r = cu.cuMemAlloc_v2(&ptr, n * sizeof(unsigned))) != CUDA_SUCCESS) {
    rc = cu_fail(r, "cuMemAlloc", "", err, err_len);
  } else if ((r = cu.cuMemsetD32Async(ptr, 0, n, (CUstream)stream)) != CUDA_SUCCESS) {
    rc = cu_fail(r, "cuMemsetD32Async", "", err, err_len);
    cu.cuMemFree_v2(ptr);
  }
  leave_context(ctx, previous, NULL, 0); /* a failed pop leaves the buffer made, and its context known */
  if (rc == 0) {
    *ctx_out = ctx;
    *ptr_out = (void *)(uintptr_t)ptr;
  }
  return rc;
}

void ot_cuda_counters_free(void *ctx, void *ptr) {
  char err[sizeof driver_error];
  CUcontext previous;
  if (!ptr || ot_cuda_driver_status(err, sizeof err) || enter_context((CUcontext)ctx, &previous, err, sizeof err))
    return;
  cu.cuMemFree_v2((CUdeviceptr)(uintptr_t)ptr); /* a context already gone took the memory with it: ignored */
  leave_context((CUcontext)ctx, previous, err, sizeof err);
}
