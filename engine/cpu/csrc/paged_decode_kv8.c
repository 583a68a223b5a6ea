/* Decode attention over an 8-bit cache (engine/modeling/kv_quant.py: rows of D codes and a bf16
 * scale), int8 or float8 e4m3 codes, for float32, bfloat16 and float16 queries (see
 * paged_decode.h): one kernel per code format, the query dtype an argument. */
#include "paged_decode.h"

DEFINE_SCALAR(scalar_i8, void, ANY_LOAD, ANY_STORE, uint8_t, I8_LOAD, 1, I8_SCALE)
DEFINE_SCALAR(scalar_e4m3, void, ANY_LOAD, ANY_STORE, uint8_t, E4M3_LOAD, 1, E4M3_SCALE)

DEFINE_VECTOR(vector_i8, void, ANY_VLOAD, ANY_STORE, uint8_t, vload_i8, 1, I8_SCALE)
DEFINE_VECTOR(vector_e4m3, void, ANY_VLOAD, ANY_STORE, uint8_t, vload_e4m3, 1, E4M3_SCALE)

DEFINE_DECODE(decode_i8, void, uint8_t, scalar_i8, vector_i8)
DEFINE_DECODE(decode_e4m3, void, uint8_t, scalar_e4m3, vector_e4m3)

/* pd_decode_<query dtype>_<code format> */
EXPORT_DECODE(pd_decode_f32_i8, void, uint8_t, decode_i8, QTYPE_F32)
EXPORT_DECODE(pd_decode_bf16_i8, void, uint8_t, decode_i8, QTYPE_BF16)
EXPORT_DECODE(pd_decode_f16_i8, void, uint8_t, decode_i8, QTYPE_F16)
EXPORT_DECODE(pd_decode_f32_e4m3, void, uint8_t, decode_e4m3, QTYPE_F32)
EXPORT_DECODE(pd_decode_bf16_e4m3, void, uint8_t, decode_e4m3, QTYPE_BF16)
EXPORT_DECODE(pd_decode_f16_e4m3, void, uint8_t, decode_e4m3, QTYPE_F16)
