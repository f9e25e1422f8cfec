/* cublas.h: the one cuBLAS call ort_triton makes (Linear beyond one row), through the cuBLAS that ORT's CUDA EP
 * has loaded and the handle it keeps for the node's stream. Nothing links against cuBLAS: the library loads and
 * plans on machines without it, and only a node that needs the GEMM fails, saying why. */
#ifndef OT_CUBLAS_H
#define OT_CUBLAS_H

#include <stddef.h>

#include "ot_table.h"

/* ORT's CUDA resources (include/onnxruntime/core/providers/cuda/cuda_resource.h, not part of the C API headers):
 * KernelContext_GetResource(context, OT_ORT_CUDA_RESOURCE_VERSION, OT_ORT_CUBLAS_HANDLE) gives the cublasHandle_t
 * that ORT made for the kernel's stream. Version 3 numbers the resources from 10000 (stream, cuDNN, cuBLAS). */
#define OT_ORT_CUDA_RESOURCE_VERSION 3
#define OT_ORT_CUBLAS_HANDLE 10002

/* gemm on handle (ORT's, bound to stream) with elements of type; ptrs as for the plan's params. 0, or 1 and why in
 * err (cuBLAS not loaded in this process, a handle on another stream, a cuBLAS error). Thread-safe. */
int ot_cublas_gemm(void *handle, void *stream, ONNXTensorElementDataType type, const ot_gemm *gemm,
                   void *const *ptrs, char *err, size_t err_len);

#endif
