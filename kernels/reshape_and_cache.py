"""Write each new token's K and V rows into its slot of the paged KV cache.

What it computes, for every token t whose slot s = slot_mapping[t] is >= 0:

    k_cache[s // block_size, :, s % block_size, :] = k[t]
    v_cache[s // block_size, :, s % block_size, :] = v[t]

or, with `kv_cache_dtype` "int8" / "fp8" (an 8-bit cache, engine/modeling/kv_quant.py), the rows
`quantize(k[t])`, `quantize(v[t])`: each (token, KV head) row's max |x|, its bfloat16
scale, the D codes and the scale's two bytes, rounded exactly as kv_quant.quantize does
(byte for byte: tests/kernels/test_reshape_and_cache.py).
A negative slot means "padding": that token is skipped and nothing is written for it.
In place; returns nothing.

Memory layout (any strides; a head_dim stride of 1 lets the copies vectorise):

    k, v              [num_tokens, num_kv_heads, head_dim]   e.g. views into a fused qkv output
    k_cache, v_cache  [num_blocks, num_kv_heads, block_size, head_dim]   one layer's views
                      kv_cache[l, 0] and kv_cache[l, 1] of the engine's single cache tensor;
                      8-bit: [..., head_dim + 2] uint8 rows (kernels/_kv8.py: 2-byte aligned,
                      so the stores are bytewise)
    slot_mapping      [num_tokens] int64; slot = block_id * block_size + offset

Limits:
- Without quantization k, v and both caches share one dtype.
- Slots are not range-checked (that needs a device sync): a slot >= num_blocks * block_size
  writes out of bounds on a GPU. Two tokens with the same slot race (last writer unknown).
- One program copies one token's rows for a tile of kv heads, at most _MAX_TILE elements.

Provenance: vLLM's `reshape_and_cache` (csrc/cache_kernels.cu) and its Triton port
`triton_reshape_and_cache_flash` (negative slot = padding, strides passed in), here for the
engine's [blocks, kv_heads, block_size, head_dim] layout and with a scale per row instead
of vLLM's per-tensor fp8 scales.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from pdserve.kernels import _kv8
from pdserve.kernels._checks import check_device
from pdserve.kernels._variants import launch

# Elements one program holds per tensor (kv heads x padded head_dim).
_MAX_TILE = 4096


@triton.jit
def _reshape_and_cache_kernel(  # type: ignore[no-untyped-def]  # Triton args stay unannotated
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    stride_kc_block,
    stride_kc_head,
    stride_kc_slot,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_head,
    stride_vc_slot,
    stride_vc_dim,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_QUANT: tl.constexpr,  # 0: copy; 1 / 2: int8 / e4m3 rows (kernels/_kv8.py)
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A padding token (slot < 0) has no heads to copy: everything is masked off (no branch and
    # no memory traffic). NOTE: not `(slot >= 0) & mask`: Triton 3.9's interpreter turns a
    # scalar-bool & tensor-bool into an int tensor, which tl.load rejects as a mask.
    num_heads_to_copy = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (offs_h[:, None] < num_heads_to_copy) & (offs_d[None, :] < head_dim)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    k_row = k_ptr + token * stride_k_token
    v_row = v_ptr + token * stride_v_token
    k = tl.load(k_row + offs_h[:, None] * stride_k_head + offs_d[None, :] * stride_k_dim, mask=mask)
    v = tl.load(v_row + offs_h[:, None] * stride_v_head + offs_d[None, :] * stride_v_dim, mask=mask)
    kc_row = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    vc_row = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    kc_heads = kc_row + offs_h * stride_kc_head  # [BLOCK_H] each head's row
    vc_heads = vc_row + offs_h * stride_vc_head
    if KV_QUANT:
        # masked columns load as 0 (tl.load's default `other` for a masked float lane is
        # undefined, so say it), which leaves each row's max |x| its own
        k = tl.where(mask, k.to(tl.float32), 0.0)
        v = tl.where(mask, v.to(tl.float32), 0.0)
        k, k_scale = _kv8.quantize_rows(k, KV_QUANT)
        v, v_scale = _kv8.quantize_rows(v, KV_QUANT)
        mask_h = offs_h < num_heads_to_copy
        # the scale's two bytes after the row's codes (little-endian bfloat16)
        kc_scale = kc_heads + head_dim * stride_kc_dim
        vc_scale = vc_heads + head_dim * stride_vc_dim
        tl.store(kc_scale, (k_scale & 0xFF).to(tl.uint8), mask=mask_h)
        tl.store(kc_scale + stride_kc_dim, (k_scale >> 8).to(tl.uint8), mask=mask_h)
        tl.store(vc_scale, (v_scale & 0xFF).to(tl.uint8), mask=mask_h)
        tl.store(vc_scale + stride_vc_dim, (v_scale >> 8).to(tl.uint8), mask=mask_h)
    tl.store(kc_heads[:, None] + offs_d[None, :] * stride_kc_dim, k, mask=mask)
    tl.store(vc_heads[:, None] + offs_d[None, :] * stride_vc_dim, v, mask=mask)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
) -> None:
    """Copy k[t], v[t] [num_kv_heads, head_dim] into slot slot_mapping[t] of one layer's cache
    (quantized into 8-bit rows for `kv_cache_dtype` "int8" / "fp8").

    Raises ValueError for mismatched shapes, dtypes or devices (see the module docstring).
    """
    _check(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    launch(
        _reshape_and_cache_kernel,
        grid,
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=k_cache.shape[2],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        KV_QUANT=_kv8.KV_QUANT[kv_cache_dtype],
        num_warps=4 if block_h * block_d >= 1024 else 1,
        # a copy, or kv_quant's rounding, which a fused multiply-add would change; saying
        # so also silences Triton 3.9's default warning
        enable_fp_fusion=False,
    )


def ref_reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    quantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Torch reference (and the CPU path): the same in-place writes, by advanced indexing.
    `quantize`: rows [..., D] -> 8-bit rows [..., D + 2] (engine/modeling/kv_quant.py's
    `quantize`, which kernels/ may not import), for an 8-bit cache."""
    if quantize is not None:
        k, v = quantize(k), quantize(v)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    # Indices on dims 0 and 2 around a slice: the indexed view is [n, num_kv_heads, head_dim].
    k_cache[blocks, :, offsets] = k[keep]
    v_cache[blocks, :, offsets] = v[keep]


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be [num_tokens, num_kv_heads, head_dim]; got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, num_kv_heads, block_size, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = k.shape
    quantized = _kv8.kv_quant_of(kv_cache_dtype) != 0
    row = head_dim + _kv8.SCALE_BYTES if quantized else head_dim
    if (k_cache.shape[1], k_cache.shape[3]) != (num_kv_heads, row):
        raise ValueError(
            f"cache {tuple(k_cache.shape)} does not hold rows of k's "
            f"(num_kv_heads, head_dim) = ({num_kv_heads}, {head_dim})"
            + (f" as {kv_cache_dtype} rows of {row} bytes" if quantized else "")
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [{num_tokens}]; got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    cache_dtype = torch.uint8 if quantized else k.dtype
    if v.dtype != k.dtype or k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype:
        raise ValueError(
            f"k, v, k_cache, v_cache must share one dtype (an 8-bit cache: uint8); got"
            f" {k.dtype}, {v.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if quantized and not k.dtype.is_floating_point:
        raise ValueError(f"k and v must be floating point to quantize; got {k.dtype}")
    check_device(
        _reshape_and_cache_kernel, "ref_reshape_and_cache", k, v, k_cache, v_cache, slot_mapping
    )
