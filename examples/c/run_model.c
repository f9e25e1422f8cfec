/* run_model.c: serve an ort_triton-optimized model with no Python, through ONNX Runtime's C API.
 *
 *   run_model MODEL.onnx LIBRARY|- cuda|cpu BATCH SEQ [OUT.bin]
 *
 * Loads the model, registers libort_triton.so (RegisterCustomOpsLibrary_V2; "-" for none: the fused ops then
 * run their ONNX function bodies, which is what a CPU session needs), runs it on the CUDA EP or the CPU, and
 * prints the first output's shape, first values and sum. Every input must be an int64 [BATCH, SEQ] tensor
 * (token ids, attention mask, token types): ids are ((b * 131 + s * 31 + 7) % 500), a mask or token-type
 * input (by name) is 1 everywhere except the second half of the last row when BATCH > 1 (mask 0 there, a
 * padded row) -- examples/c/build_and_run.sh makes the same inputs in Python and compares. OUT.bin gets the
 * first output as raw float32. Every ORT call is checked; on failure the message is printed and the exit
 * code is 1. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "onnxruntime_c_api.h"

static const OrtApi *api;

/* Prints and releases a failed status; returns 1 if there was one. */
static int failed(OrtStatus *status, const char *doing) {
  if (!status) return 0;
  fprintf(stderr, "run_model: %s failed: %s\n", doing, api->GetErrorMessage(status));
  api->ReleaseStatus(status);
  return 1;
}

#define CHECK(call, doing) \
  do {                     \
    if (failed((call), (doing))) goto done; \
  } while (0)

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else { /* subnormal: renormalise */
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) mant <<= 1, exp--;
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static int is_mask_like(const char *name) {
  return strstr(name, "mask") != NULL || strstr(name, "token_type") != NULL;
}

int main(int argc, char **argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: %s MODEL.onnx LIBRARY|- cuda|cpu BATCH SEQ [OUT.bin]\n", argv[0]);
    return 2;
  }
  const char *model_path = argv[1], *library = argv[2], *device = argv[3], *out_path = argc > 6 ? argv[6] : NULL;
  const int64_t batch = atoll(argv[4]), seq = atoll(argv[5]);
  if (batch < 1 || seq < 1 || (strcmp(device, "cuda") && strcmp(device, "cpu"))) {
    fprintf(stderr, "run_model: BATCH and SEQ must be >= 1 and the device cuda or cpu\n");
    return 2;
  }
  api = OrtGetApiBase()->GetApi(ORT_API_VERSION);
  if (!api) {
    fprintf(stderr, "run_model: this libonnxruntime does not offer C API version %d\n", ORT_API_VERSION);
    return 1;
  }
  int rc = 1;
  OrtEnv *env = NULL;
  OrtSessionOptions *so = NULL;
  OrtCUDAProviderOptionsV2 *cuda = NULL;
  OrtSession *session = NULL;
  OrtMemoryInfo *cpu_mem = NULL;
  OrtAllocator *alloc = NULL;
  OrtValue *inputs[8] = {0}, *outputs[1] = {0};
  char *names[8] = {0}, *out_name = NULL;
  int64_t *data[8] = {0};
  size_t n_in = 0;

  CHECK(api->CreateEnv(ORT_LOGGING_LEVEL_WARNING, "run_model", &env), "creating the environment");
  CHECK(api->CreateSessionOptions(&so), "creating session options");
  if (strcmp(library, "-")) CHECK(api->RegisterCustomOpsLibrary_V2(so, library), "registering the ort_triton library");
  if (!strcmp(device, "cuda")) {
    CHECK(api->CreateCUDAProviderOptions(&cuda), "creating CUDA options");
    CHECK(api->SessionOptionsAppendExecutionProvider_CUDA_V2(so, cuda), "adding the CUDA execution provider");
  }
  CHECK(api->CreateSession(env, model_path, so, &session), "creating the session");
  CHECK(api->GetAllocatorWithDefaultOptions(&alloc), "getting the allocator");
  CHECK(api->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &cpu_mem), "creating CPU memory info");

  CHECK(api->SessionGetInputCount(session, &n_in), "counting inputs");
  if (n_in > 8) {
    fprintf(stderr, "run_model: %zu inputs; this example takes at most 8\n", n_in);
    goto done;
  }
  const int64_t dims[2] = {batch, seq};
  for (size_t i = 0; i < n_in; i++) {
    CHECK(api->SessionGetInputName(session, i, alloc, &names[i]), "reading an input name");
    data[i] = malloc(sizeof(int64_t) * (size_t)(batch * seq));
    if (!data[i]) goto done;
    for (int64_t b = 0; b < batch; b++) {
      for (int64_t s = 0; s < seq; s++) {
        int64_t v = (b * 131 + s * 31 + 7) % 500;
        if (is_mask_like(names[i])) v = (batch > 1 && b == batch - 1 && s >= seq / 2) ? 0 : 1;
        if (strstr(names[i], "token_type")) v = 0;
        data[i][b * seq + s] = v;
      }
    }
    CHECK(api->CreateTensorWithDataAsOrtValue(cpu_mem, data[i], sizeof(int64_t) * (size_t)(batch * seq), dims, 2,
                                              ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, &inputs[i]),
          "making an input tensor");
  }
  CHECK(api->SessionGetOutputName(session, 0, alloc, &out_name), "reading the output name");
  const char *out_names[1] = {out_name};
  CHECK(api->Run(session, NULL, (const char *const *)names, (const OrtValue *const *)inputs, n_in, out_names, 1,
                 outputs),
        "running the model");

  OrtTensorTypeAndShapeInfo *info = NULL;
  CHECK(api->GetTensorTypeAndShape(outputs[0], &info), "reading the output shape");
  size_t rank = 0, count = 0;
  int64_t shape[8] = {0};
  ONNXTensorElementDataType type;
  failed(api->GetDimensionsCount(info, &rank), "reading the rank");
  failed(api->GetDimensions(info, shape, rank < 8 ? rank : 8), "reading the dims");
  failed(api->GetTensorShapeElementCount(info, &count), "counting elements");
  failed(api->GetTensorElementType(info, &type), "reading the element type");
  api->ReleaseTensorTypeAndShapeInfo(info);
  void *raw = NULL;
  CHECK(api->GetTensorMutableData(outputs[0], &raw), "reading the output");
  if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
    fprintf(stderr, "run_model: output %s has element type %d; this example prints float32 or float16\n", out_name,
            (int)type);
    goto done;
  }
  float *values = malloc(sizeof(float) * (count ? count : 1));
  if (!values) goto done;
  double sum = 0;
  for (size_t k = 0; k < count; k++) {
    values[k] = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? ((float *)raw)[k] : half_to_float(((uint16_t *)raw)[k]);
    sum += values[k];
  }
  printf("%s: shape [", out_name);
  for (size_t d = 0; d < rank; d++) printf(d ? ", %lld" : "%lld", (long long)shape[d]);
  printf("] on %s; first values", device);
  for (size_t k = 0; k < count && k < 4; k++) printf(" %.6f", values[k]);
  printf("; sum %.6f\n", sum);
  if (out_path) {
    FILE *f = fopen(out_path, "wb");
    if (!f || fwrite(values, sizeof(float), count, f) != count) {
      fprintf(stderr, "run_model: cannot write %s\n", out_path);
      if (f) fclose(f);
      free(values);
      goto done;
    }
    fclose(f);
  }
  free(values);
  rc = 0;

done:
  for (size_t i = 0; i < 8; i++) {
    if (inputs[i]) api->ReleaseValue(inputs[i]);
    if (names[i] && alloc) failed(api->AllocatorFree(alloc, names[i]), "freeing a name");
    free(data[i]);
  }
  if (out_name && alloc) failed(api->AllocatorFree(alloc, out_name), "freeing a name");
  if (outputs[0]) api->ReleaseValue(outputs[0]);
  if (cpu_mem) api->ReleaseMemoryInfo(cpu_mem);
  if (session) api->ReleaseSession(session);
  if (cuda) api->ReleaseCUDAProviderOptions(cuda);
  if (so) api->ReleaseSessionOptions(so);
  if (env) api->ReleaseEnv(env);
  return rc;
}
