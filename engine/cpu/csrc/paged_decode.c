/* Decode attention over a cache of the model's dtype: float32, bfloat16, float16 (see
 * paged_decode.h). Each dtype is its own kernel, with q, K and V loads inlined. */
#include "paged_decode.h"

DEFINE_SCALAR(scalar_f32, float, F32_LOAD, F32_STORE, float, F32_LOAD, 0, NO_SCALE)
DEFINE_SCALAR(scalar_bf16, uint16_t, BF16_LOAD, BF16_STORE, uint16_t, BF16_LOAD, 0, NO_SCALE)
DEFINE_SCALAR(scalar_f16, _Float16, F16_LOAD, F16_STORE, _Float16, F16_LOAD, 0, NO_SCALE)

DEFINE_VECTOR(vector_f32, float, F32_VLOAD, F32_STORE, float, vload_f32, 0, NO_SCALE)
DEFINE_VECTOR(vector_bf16, uint16_t, BF16_VLOAD, BF16_STORE, uint16_t, vload_bf16, 0, NO_SCALE)
DEFINE_VECTOR(vector_f16, _Float16, F16_VLOAD, F16_STORE, _Float16, vload_f16, 0, NO_SCALE)

DEFINE_DECODE(decode_f32, float, float, scalar_f32, vector_f32)
DEFINE_DECODE(decode_bf16, uint16_t, uint16_t, scalar_bf16, vector_bf16)
DEFINE_DECODE(decode_f16, _Float16, _Float16, scalar_f16, vector_f16)

EXPORT_DECODE(pd_decode_f32, float, float, decode_f32, QTYPE_F32)
EXPORT_DECODE(pd_decode_bf16, uint16_t, uint16_t, decode_bf16, QTYPE_BF16)
EXPORT_DECODE(pd_decode_f16, _Float16, _Float16, decode_f16, QTYPE_F16)
