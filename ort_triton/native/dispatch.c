/* dispatch.c: choosing a specialisation from its dispatch keys, and a kernel image for a GPU arch.
 * Pure table lookups with no CUDA, so the test hooks can check them on a machine without a GPU. */
#include <stdio.h>

#include "cuda_driver.h"
#include "ot_table.h"

/* A cubin built for sm_XY runs on any sm_XZ with Z >= Y but never across majors, so take the same
 * major with the largest minor that does not exceed the device's. */
static const ot_image *best_image(const ot_spec *spec, int arch) {
  const ot_image *best = NULL;
  for (int i = 0; i < spec->n_images; i++) {
    const ot_image *img = &spec->images[i];
    if (img->arch / 10 == arch / 10 && img->arch <= arch && (!best || img->arch > best->arch)) best = img;
  }
  return best;
}

static int keys_fit(const ot_spec *spec, const int64_t *keys, int n_keys) {
  if (spec->n_keys != n_keys) return 0;
  for (int i = 0; i < n_keys; i++)
    if (keys[i] < spec->key_min[i] || keys[i] > spec->key_max[i]) return 0;
  return 1;
}

const ot_spec *ot_find_spec(const ot_op *op, const int64_t *keys, int n_keys, int arch) {
  const ot_spec *first = NULL;
  for (int s = 0; s < op->n_specs; s++) {
    const ot_spec *spec = &op->specs[s];
    if (!keys_fit(spec, keys, n_keys)) continue;
    if (arch == 0 || best_image(spec, arch)) return spec;
    if (!first) first = spec;
  }
  return first;
}

const ot_image *ot_pick_image(const ot_spec *spec, int arch, char *err, size_t err_len) {
  const ot_image *best = best_image(spec, arch);
  if (best) return best;

  char held[8 * OT_MAX_ARCHS] = "";
  size_t used = 0;
  for (int i = 0; i < spec->n_images && used < sizeof held; i++)
    used += (size_t)snprintf(held + used, sizeof held - used, "%ssm_%d", i ? ", " : "", spec->images[i].arch);
  snprintf(err, err_len,
           "no kernel image for this GPU (sm_%d); this library holds kernels for %s; "
           "rebuild with: ort-triton build --arch %d",
           arch, spec->n_images ? held : "no arch", arch);
  return NULL;
}
