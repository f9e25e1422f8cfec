/* cuda_driver.h: the little of the CUDA driver that ort_triton needs, behind two calls.
 * The driver is opened with dlopen at the first launch, so the library loads and registers its ops on
 * machines without a GPU. Both calls write a message without the "ort_triton <Op> (<type>): " prefix,
 * which the caller adds. */
#ifndef OT_CUDA_DRIVER_H
#define OT_CUDA_DRIVER_H

#include <stddef.h>

#include "ot_table.h"

/* The image of spec to run on a GPU of arch (10 * major + minor); NULL and a message naming the archs
 * the library holds when none fits. Implemented in dispatch.c: it needs no driver. */
const ot_image *ot_pick_image(const ot_spec *spec, int arch, char *err, size_t err_len);

/* Opens the driver if that has not been tried yet: 0 when it is usable, else 1 and the reason in err
 * (the message a launch would give). Thread-safe. */
int ot_cuda_driver_status(char *err, size_t err_len);

/* Launch spec's kernel on stream (a CUstream; NULL: the current context's default stream) with the
 * image that fits the stream's device. params is the full parameter array cuLaunchKernel takes.
 * Thread-safe. Returns 0, or nonzero with a message in err. */
/* The arch (10 * major + minor) of the device whose context owns stream (NULL: the current context);
 * 0 on success, 1 when there is no usable driver or context (the launch then says why). */
int ot_cuda_stream_arch(void *stream, int *arch);

int ot_cuda_launch(const ot_spec *spec, const unsigned grid[3], void *stream, void **params, char *err,
                   size_t err_len);

/* Launches so far with programmatic stream serialization (ORT_TRITON_PDL=1, images built with PDL = 1). */
long ot_cuda_pdl_launches(void);

/* n zeroed 32-bit counters in the context that owns stream (zeroed on the stream, so before anything enqueued on it
 * after): 0 with the context and the device pointer, or 1 and why in err: no usable driver, an allocation that
 * failed, or a stream capturing a CUDA graph (no allocation inside a capture). Thread-safe. */
int ot_cuda_counters(void *stream, size_t n, void **ctx, void **ptr, char *err, size_t err_len);

/* Frees what ot_cuda_counters made, with its context current for the call; failures are ignored (a context torn
 * down already took the memory with it). */
void ot_cuda_counters_free(void *ctx, void *ptr);

#endif
