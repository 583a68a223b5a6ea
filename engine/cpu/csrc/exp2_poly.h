/* 2^f for f in [-0.5, 0.5]: a degree-6 polynomial, relative error about 2e-7. The exp of
 * the attention kernels (paged_decode.h, exp_neg) and of the SiLU (model_ops.c, exp_any)
 * split 2^(x log2 e) into an integer power, set in the exponent bits, and this. */
#ifndef PDSERVE_EXP2_POLY_H
#define PDSERVE_EXP2_POLY_H

static inline float exp2_poly(float f) {
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6180230e-3f;
    p = p * f + 5.5503406e-2f;
    p = p * f + 2.4022652e-1f;
    p = p * f + 6.9314718e-1f;
    return p * f + 1.0f;
}

#endif
