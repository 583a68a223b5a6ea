/* bfloat16 <-> float32 for the C kernels, as torch converts: widening is exact (a bf16
 * value is a float32 with its low 16 bits zero); narrowing rounds to nearest even, and a
 * NaN stays a (quiet) NaN. Branch-free (a select for NaN), so that loops vectorize. */
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H
#include <stdint.h>

static inline __attribute__((always_inline)) float pd_from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline __attribute__((always_inline)) uint16_t pd_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    const uint32_t nan = (v.u >> 16) | 0x40u;
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
#endif
