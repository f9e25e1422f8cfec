/* cublas.c: cublasGemmEx through the cuBLAS that ORT's CUDA EP loaded (see cublas.h). */
#include "cublas.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

/* cuBLAS's and the CUDA runtime's enum values (cublas_api.h, library_types.h), stable across their releases. */
enum { OP_N = 0, OP_T = 1 };
enum { R_32F = 0, R_16F = 2, R_16BF = 14 };
enum { COMPUTE_32F = 68 };
enum { GEMM_DEFAULT = -1 };

typedef int (*gemm_ex_fn)(void *handle, int transa, int transb, int m, int n, int k, const void *alpha,
                          const void *a, int a_type, int lda, const void *b, int b_type, int ldb, const void *beta,
                          void *c, int c_type, int ldc, int compute, int algo);
typedef int (*get_stream_fn)(void *handle, void **stream);
typedef const char *(*status_string_fn)(int status);

static struct {
  pthread_once_t once;
  gemm_ex_fn gemm_ex;
  get_stream_fn get_stream;
  status_string_fn status_string; /* NULL before cuBLAS 11.4 */
  char soname[32];
} cublas = {.once = PTHREAD_ONCE_INIT};

/* The cuBLAS already in the process (ORT's CUDA EP links it): RTLD_NOLOAD, so a second, different cuBLAS is never
 * loaded beside ORT's, whose handle must be used with its own library. */
static void open_cublas(void) {
  static const char *const sonames[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so.11"};
  for (size_t i = 0; i < sizeof sonames / sizeof sonames[0]; i++) {
    void *lib = dlopen(sonames[i], RTLD_NOW | RTLD_NOLOAD);
    if (!lib) continue;
    cublas.gemm_ex = (gemm_ex_fn)dlsym(lib, "cublasGemmEx");
    cublas.get_stream = (get_stream_fn)dlsym(lib, "cublasGetStream_v2");
    cublas.status_string = (status_string_fn)dlsym(lib, "cublasGetStatusString");
    snprintf(cublas.soname, sizeof cublas.soname, "%s", sonames[i]);
    if (cublas.gemm_ex && cublas.get_stream) return;
    cublas.gemm_ex = NULL;
  }
}

static int cuda_type(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return R_32F;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return R_16F;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return R_16BF;
    default: return -1;
  }
}

int ot_cublas_gemm(void *handle, void *stream, ONNXTensorElementDataType type, const ot_gemm *g,
                   void *const *ptrs, char *err, size_t err_len) {
  pthread_once(&cublas.once, open_cublas);
  if (!cublas.gemm_ex) {
    snprintf(err, err_len, "this node runs cuBLAS (more than one row) but no cuBLAS 11-13 with cublasGemmEx is "
                           "loaded in this process; run the model on ORT's CUDA execution provider");
    return 1;
  }
  const int t = cuda_type(type);
  if (t < 0) {
    snprintf(err, err_len, "cuBLAS is given element type %d; ort_triton runs it for float, float16, bfloat16", type);
    return 1;
  }
  if (g->m > INT32_MAX || g->n > INT32_MAX || g->k > INT32_MAX || g->lda > INT32_MAX || g->ldb > INT32_MAX ||
      g->ldc > INT32_MAX) {
    snprintf(err, err_len, "GEMM %lld x %lld x %lld exceeds cublasGemmEx's 32-bit sizes", (long long)g->m,
             (long long)g->n, (long long)g->k);
    return 1;
  }
  /* ORT binds each stream's handle to that stream when it makes it; setting it here would also reset the
   * handle's workspace (cublasSetStream does), so a handle on another stream is refused instead. */
  void *bound = NULL;
  int status = cublas.get_stream(handle, &bound);
  if (status || bound != stream) {
    snprintf(err, err_len, "ORT's cuBLAS handle is bound to stream %p, the node runs on %p (status %d); cuBLAS "
                           "would run out of order", bound, stream, status);
    return 1;
  }
  const float one = 1.0f, zero = 0.0f;
  status = cublas.gemm_ex(handle, g->trans_a ? OP_T : OP_N, g->trans_b ? OP_T : OP_N, (int)g->m, (int)g->n,
                          (int)g->k, &one, ptrs[g->a], t, (int)g->lda, ptrs[g->b], t, (int)g->ldb, &zero,
                          ptrs[g->c], t, (int)g->ldc, COMPUTE_32F, GEMM_DEFAULT);
  if (status) {
    snprintf(err, err_len, "cublasGemmEx (%s) failed on m=%lld n=%lld k=%lld: %s (status %d)", cublas.soname,
             (long long)g->m, (long long)g->n, (long long)g->k,
             cublas.status_string ? cublas.status_string(status) : "see cublas_api.h", status);
    return 1;
  }
  return 0;
}
