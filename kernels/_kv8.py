"""The 8-bit KV cache format in Triton: row scales, code encode/decode, launcher checks.

The format is the engine's (engine/modeling/kv_quant.py; its constants are
pdserve/common/kv_format.py): a cache row, one token of one KV head, is `D + 2` bytes,

    [ D codes (int8, or float8 e4m3fn bits) | scale (bfloat16, little-endian) ]

and each value is `code * scale`, with `scale = bf16(max|x| / QMAX)` (at least bf16's
smallest normal) and `code = round(clamp(x / scale, +-QMAX))`, ties to even.

Alignment, and what it costs on a GPU: a row starts at a multiple of `D + 2` bytes, so for
an even D it is 2-byte aligned and never 16-byte aligned (D + 2 = 66 or 130). Triton
specialises a stride on divisibility by 16 only, so code loads and stores are not
vectorised to 16 bytes per thread: each thread moves single bytes (a warp's bytes of one
row still coalesce into the same 32-byte sectors, so the DRAM traffic is the row's, but
the load instructions are up to 16x more). The scale is read as two bytes, which works
for any D. A layout keeping each block's scales apart from its codes would make the code
rows 16-byte aligned; this one keeps a row's scale inside its block for the handoff
(kernels/kv_pack.py moves whole blocks).

Everything here is plain integer and float32 arithmetic that the interpreter
(TRITON_INTERPRET=1) runs exactly as a GPU does, except `FP8_NATIVE` decoding, which uses
Triton's float8e4nv conversion (one instruction on sm_89+; the interpreter has it too).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.common.kv_format import KV_QUANT, MIN_SCALE, SCALE_BYTES
from pdserve.common.kv_format import QMAX as _QMAX_OF_DTYPE

# KV_QUANT constant -> its largest code
QMAX = {KV_QUANT[name]: qmax for name, qmax in _QMAX_OF_DTYPE.items()}
# (constants a jit function reads must be tl.constexpr)
_MIN_SCALE = tl.constexpr(MIN_SCALE)
# 1.5 * 2^23: (x + _ROUND) - _ROUND rounds |x| < 2^22 to an integer, ties to even
_ROUND = tl.constexpr(12582912.0)


def kv_quant_of(kv_cache_dtype: str) -> int:
    """The KV_QUANT constant of a cache format; ValueError for an unknown one."""
    if kv_cache_dtype not in KV_QUANT:
        raise ValueError(
            f"kv_cache_dtype must be one of {sorted(KV_QUANT)}, got {kv_cache_dtype!r}"
        )
    return KV_QUANT[kv_cache_dtype]


@functools.cache  # asked at every launch (CUDA graph captures included): no device query
def fp8_native(device: torch.device) -> bool:
    """Whether Triton converts float8e4nv here: compute capability 8.9+ (Ada, Hopper), or
    the interpreter; older GPUs decode e4m3 bits arithmetically (`codes_to`)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def check_cache_rows(
    cache: torch.Tensor, head_dim: int, kv_cache_dtype: str, value_dtype: torch.dtype, what: str
) -> None:
    """`cache` [..., row] holds rows of `kv_cache_dtype` for values of `head_dim` and
    `value_dtype` (uint8 rows of head_dim + 2 bytes for an 8-bit format)."""
    quant = kv_quant_of(kv_cache_dtype)
    dtype, row = (torch.uint8, head_dim + SCALE_BYTES) if quant else (value_dtype, head_dim)
    if cache.dtype != dtype or cache.shape[-1] != row:
        raise ValueError(
            f"{what} must hold rows of {row} {dtype} for head_dim {head_dim} and"
            f" kv_cache_dtype={kv_cache_dtype!r}; got {tuple(cache.shape)} {cache.dtype}"
        )


@triton.jit
def row_scales(row_ptrs, HEAD_DIM: tl.constexpr, stride_d, mask):  # type: ignore[no-untyped-def]
    """The float32 scales of rows starting at `row_ptrs` (uint8 pointers, any shape):
    the bfloat16 in bytes HEAD_DIM, HEAD_DIM + 1, read bytewise (rows are 2-byte aligned
    at best). Masked rows read 0."""
    lo = tl.load(row_ptrs + HEAD_DIM * stride_d, mask=mask, other=0).to(tl.uint32)
    hi = tl.load(row_ptrs + (HEAD_DIM + 1) * stride_d, mask=mask, other=0).to(tl.uint32)
    return ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)


@triton.jit
def codes_to(  # type: ignore[no-untyped-def]
    codes, KV_QUANT: tl.constexpr, FP8_NATIVE: tl.constexpr, dtype: tl.constexpr
):
    """uint8 codes as values of `dtype` before their row's scale (exact in float16,
    bfloat16 and float32: at most 4 significant bits, exponents within range)."""
    if KV_QUANT == 1:
        return codes.to(tl.int8, bitcast=True).to(dtype)
    elif FP8_NATIVE:
        return codes.to(tl.float8e4nv, bitcast=True).to(dtype)
    else:
        # e4m3's sign, exponent and mantissa fields moved into a float16's: the code's
        # value / 2^8, subnormals included (0x7f, e4m3's NaN, reads 480: never written)
        c = codes.to(tl.uint16)
        half = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.float16, bitcast=True)
        return (half.to(tl.float32) * 256.0).to(dtype)


@triton.jit
def bf16_round(x):  # type: ignore[no-untyped-def]
    """float32 `x` (finite, >= 0) rounded to bfloat16, ties to even, as a float32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(v):  # type: ignore[no-untyped-def]
    """float32 `v` with |v| <= 448 as float8 e4m3fn bits (uint32), rounded to nearest,
    ties to even: torch's `.to(torch.float8_e4m3fn)`, sign of zero included."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal (|v| >= 2^-6): drop 20 mantissa bits with ties to even (a carry moves into
    # the exponent), then rebias the exponent from 127 to 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: multiples of 2^-9 (8 of them is 2^-6, the smallest normal: code 8)
    steps = mag.to(tl.float32, bitcast=True) * 512.0
    sub = ((steps + _ROUND) - _ROUND).to(tl.uint32)
    return tl.where(mag < (121 << 23), sub, normal) | sign


@triton.jit
def quantize_rows(x, KV_QUANT: tl.constexpr):  # type: ignore[no-untyped-def]
    """float32 rows `x` [R, BLOCK_D] (columns past head_dim zero) -> (codes [R, BLOCK_D]
    uint8, scale bits [R] uint32 holding the bfloat16 in the low 16 bits), rounded as
    engine/modeling/kv_quant.py's `quantize`: IEEE divisions (`div_rn`: a GPU's `/` may be
    approximate), the int8 rounding ties to even like torch's `round`."""
    qmax = 127.0 if KV_QUANT == 1 else 448.0
    amax = tl.max(tl.abs(x), axis=1)
    scale = bf16_round(tl.maximum(tl.math.div_rn(amax, qmax), _MIN_SCALE))
    scaled = tl.math.div_rn(x, scale[:, None])
    scaled = tl.minimum(tl.maximum(scaled, -qmax), qmax)
    if KV_QUANT == 1:
        codes = ((scaled + _ROUND) - _ROUND).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        codes = e4m3_bits(scaled).to(tl.uint8)
    return codes, scale.to(tl.uint32, bitcast=True) >> 16
