"""The 8-bit KV cache format's constants, shared by the torch reference
(engine/modeling/kv_quant.py, which describes the format) and the Triton kernels
(kernels/_kv8.py).

A cache row, one token of one KV head, is `D` codes then one bfloat16 scale:
`D + SCALE_BYTES` bytes, each value `code * scale`, `scale = bf16(max|x| / QMAX)` and at
least `MIN_SCALE`.
"""

from __future__ import annotations

# EngineConfig.kv_cache_dtype values stored in 8 bits
QUANTIZED: tuple[str, ...] = ("int8", "fp8")
SCALE_BYTES = 2  # one bfloat16 per row
# the largest code's magnitude: int8's 127, float8 e4m3's 448
QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
# bfloat16's smallest normal, the floor of a scale: an all-zero row's codes are then 0
MIN_SCALE = 2.0**-126
# EngineConfig.kv_cache_dtype -> the kernels' KV_QUANT constant (0: a cache of q's dtype)
KV_QUANT: dict[str, int] = {"auto": 0, "int8": 1, "fp8": 2}
