"""8-bit KV cache: the storage format, and its quantize/dequantize reference in torch.

`EngineConfig.kv_cache_dtype` "int8" or "fp8" (float8 e4m3) stores each token's K and V
in 8 bits per value instead of the model's 16 (or 32): a decode step reads half the KV
bytes, the same memory holds about twice the blocks, and a handoff ships half the bytes.

**Format.** The cache stays one tensor [layers, 2, blocks, kv_heads, block_size, row]
(engine/modeling/attention.py), of dtype uint8, where a *row* is one token of one KV head:

    row = [ D codes (int8, or float8 e4m3 bits) | its scale (bfloat16, 2 bytes) ]

so a row holds `D + 2` bytes, and `x ~ code * scale` for each of its D values. A block is
still one contiguous chunk (a transfer packs whole blocks, kernels/kv_pack.py, and needs
no change: it moves bytes), and its scales travel inside it.

**One scale per (token, KV head)**, computed from that row alone at cache-write time:
`scale = bf16(max|x| / QMAX)` (QMAX 127 for int8, 448 for e4m3), `code = x / scale`
rounded to the nearest code (int8: clamped to +-127; e4m3: clamped to +-448, then cast
with round-to-nearest-even). A finer grain than one scale per block and head, chosen for
exactness: a row's codes depend on its own values only, never on which other tokens
shared its block, in what order they were written, or where the chunk boundaries of a
chunked prefill fell. So a request gets the same cache, byte for byte, whether its prompt
was prefilled in one chunk or several, on a prefill worker or locally, with a prefix hit
or without, with speculative decoding (rejected tokens never touch an accepted row's
scale) or without; a block scale would change with each of those, and with it the tokens.
The cost is 2 bytes per row: a bf16 cache row is 2D bytes, an 8-bit one D + 2 (0.52x at
D = 64, 0.51x at D = 128). A bf16 scale has float32's range, so no model's activations
overflow or underflow it; its 8-bit mantissa makes the grid at most 0.4% coarser than an
exact max|x| / QMAX would, and the clamp keeps codes in range either way.

**What attention sees.** Every backend attends over the dequantized values
`code * scale` of *every* token, the chunk's own tokens included (the torch backend
rounds a prefill chunk's fresh K/V through the format too, `fake_quantize`; the Triton
kernels read them back from the cache): the model is "the model with its K/V rounded to
8 bits", whatever the batch, chunking or placement. Tests compare it, token for token,
with `transformers` running the same rounding (`fake_quantize` on its K/V).

Plain torch here (the constants are pdserve/common/kv_format.py); the C decode kernel
(engine/cpu/csrc/paged_decode_kv8.c) and the Triton kernels (kernels/) read the same rows.
"""

from __future__ import annotations

import torch

from pdserve.common.kv_format import MIN_SCALE as _MIN_SCALE
from pdserve.common.kv_format import QMAX as _QMAX
from pdserve.common.kv_format import QUANTIZED, SCALE_BYTES

__all__ = ["QUANTIZED", "SCALE_BYTES", "SCALE_DTYPE"]

SCALE_DTYPE = torch.bfloat16
_CODE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in QUANTIZED


def row_bytes(kv_cache_dtype: str, head_dim: int, model_itemsize: int) -> int:
    """Bytes of one row (a token of one KV head, K or V) in the cache."""
    if is_quantized(kv_cache_dtype):
        return head_dim + SCALE_BYTES
    return head_dim * model_itemsize


def code_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The dtype of a quantized row's codes (int8, or float8_e4m3fn)."""
    return _CODE_DTYPE[kv_cache_dtype]


def qmax(kv_cache_dtype: str) -> float:
    return _QMAX[kv_cache_dtype]


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """`x` [..., D] (any float dtype) as rows [..., D + 2] uint8: codes, then the scale."""
    limit = _QMAX[kv_cache_dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # NOTE: a tensor divisor: CUDA torch turns division by a Python number into a multiply
    # by its reciprocal, which can round a scale differently from the CPU and the Triton
    # write (kernels/reshape_and_cache.py divides, IEEE)
    scale = (amax / amax.new_full((), limit)).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
    scaled = (xf / scale.float()).clamp(-limit, limit)
    if kv_cache_dtype == "int8":
        codes = scaled.round().to(torch.int8)
    else:
        codes = scaled.to(torch.float8_e4m3fn)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D + 2] uint8 back to values [..., D] of `dtype` (computed in float32)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :head_dim].view(_CODE_DTYPE[kv_cache_dtype])
    return (codes.float() * scales(rows).float()).to(dtype)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The scales [..., 1] (bfloat16) of rows [..., D + 2] uint8, a view where the
    bytes are aligned (an even D in a cache or a gather of it), else a copy."""
    tail = rows[..., rows.shape[-1] - SCALE_BYTES :]
    aligned = tail.storage_offset() % 2 == 0 and all(
        st % 2 == 0 for st, n in zip(tail.stride()[:-1], tail.shape[:-1], strict=True) if n > 1
    )
    if not (aligned and tail.stride(-1) == 1):
        tail = tail.clone(memory_format=torch.contiguous_format)
    return tail.view(SCALE_DTYPE)


def fake_quantize(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """`x` rounded through the format: what attention reads back for it."""
    return dequantize(quantize(x, kv_cache_dtype), kv_cache_dtype, x.dtype)
