"""Gather KV blocks of every layer into one contiguous buffer, and scatter such a buffer back.

This buffer is what a prefill worker ships to a decode worker: a wire format, identical on
both sides.

Cache layout (the engine's single KV tensor, or a slice of its layers for one layer group):

    kv_cache  [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]   (index 0 = K, 1 = V)

with each block's [num_kv_heads, block_size, head_dim] chunk contiguous (true of the engine's
contiguous tensor and of any slice kv_cache[l0:l1]).

Buffer layout (the wire format), for block_ids = [b_0, ..., b_{n-1}]:

    buffer    [num_layers, 2, n, num_kv_heads, block_size, head_dim], C-contiguous,
              same dtype as the cache, native (little-endian) byte order
    buffer[l, kv, i] == kv_cache[l, kv, block_ids[i]]
    byte offset of buffer[l, kv, i, h, s, d] =
        (((((l * 2 + kv) * n + i) * num_kv_heads + h) * block_size + s) * head_dim + d) * itemsize
    total bytes = num_layers * 2 * n * num_kv_heads * block_size * head_dim * itemsize
                = kv_pack_num_bytes(...)

So the buffer is layer-major: layer 0's K rows of all n blocks, then layer 0's V rows, then
layer 1, ... The block order is the order of block_ids, i.e. the sequence's order; the
receiver scatters buffer block i into its own block id for that position.

Both directions are a pure byte copy: the kernel moves the bits through an integer view of the
same item size, so any dtype works (fp32, fp16, bf16, fp8) and NaN payloads survive unchanged;
an 8-bit KV cache (engine/modeling/kv_quant.py: uint8 rows of codes and their scale) moves as bytes,
its scales inside their blocks.

Limits: both sides must agree on dtype and on (num_layers, num_kv_heads, block_size, head_dim);
block ids are range-checked (one small device sync); kv_unpack rejects repeated block ids (two
chunks racing for one block). One program copies a tile of at most _MAX_TILE elements of one
(layer, K or V, block) chunk.

Provenance: vLLM's `copy_blocks` cache kernel (csrc/cache_kernels.cu: one program per
(layer, block), contiguous copies through the block's flat chunk), applied to the block-list
gather/scatter that disaggregated-prefill KV connectors do around a send.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import check_device
from pdserve.kernels._variants import launch

_MAX_TILE = 4096
# A same-sized integer view per item size: the copy moves bits, never floating-point values.
_BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# The buffer's layer and K/V strides follow the number of blocks packed: Triton's own
# specialisation of them (divisible by 16) would make a variant per kind of count
# (kernels/_variants.py). The cache's strides and a block's size are fixed.
@triton.jit(do_not_specialize=["stride_buffer_layer", "stride_buffer_kv"])
def _kv_pack_kernel(  # type: ignore[no-untyped-def]  # Triton args stay unannotated
    cache_ptr,
    buffer_ptr,
    block_ids_ptr,
    chunk_numel,
    stride_cache_layer,
    stride_cache_kv,
    stride_cache_block,
    stride_buffer_layer,
    stride_buffer_kv,
    stride_buffer_block,
    TO_BUFFER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Grid: (listed block i, layer * 2 + kv, tile of the block's chunk).
    i = tl.program_id(0).to(tl.int64)
    layer = (tl.program_id(1) // 2).to(tl.int64)
    kv = tl.program_id(1) % 2
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk_numel
    block_id = tl.load(block_ids_ptr + i).to(tl.int64)
    cache_chunk = (
        cache_ptr
        + layer * stride_cache_layer
        + kv * stride_cache_kv
        + block_id * stride_cache_block
    )
    buffer_chunk = (
        buffer_ptr + layer * stride_buffer_layer + kv * stride_buffer_kv + i * stride_buffer_block
    )
    if TO_BUFFER:
        tl.store(buffer_chunk + offs, tl.load(cache_chunk + offs, mask=mask), mask=mask)
    else:
        tl.store(cache_chunk + offs, tl.load(buffer_chunk + offs, mask=mask), mask=mask)


def kv_pack_num_bytes(
    *,
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """Byte size of the buffer that packs `num_blocks` blocks of a cache of this layout."""
    return num_layers * 2 * num_blocks * num_kv_heads * block_size * head_dim * dtype.itemsize


def kv_pack(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather blocks `block_ids` [n] of every layer into buffer [L, 2, n, KVH, BS, D].

    `out`, when given, must be a contiguous tensor of exactly that shape and the cache's dtype
    and device; it is filled and returned. Raises ValueError on a bad cache, ids or `out`.
    """
    _check_cache(kv_cache)
    ids = _block_ids_on_device(block_ids, kv_cache, allow_repeats=True)
    shape = _buffer_shape(kv_cache, ids.numel())
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    _check_buffer(out, kv_cache, shape, "out")
    _launch(kv_cache, out, ids, to_buffer=True)
    return out


def kv_unpack(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Scatter buffer [L, 2, n, KVH, BS, D] into blocks `block_ids` [n] of `kv_cache`, in place.

    The ids may differ from the ones the sender packed: they are the receiver's blocks.
    Raises ValueError on a bad cache or buffer, on ids out of range and on repeated ids.
    """
    _check_cache(kv_cache)
    ids = _block_ids_on_device(block_ids, kv_cache, allow_repeats=False)
    _check_buffer(buffer, kv_cache, _buffer_shape(kv_cache, ids.numel()), "buffer")
    _launch(kv_cache, buffer, ids, to_buffer=False)


def ref_kv_pack(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Torch reference (and the CPU path) of kv_pack."""
    return kv_cache.index_select(2, block_ids.long()).contiguous()


def ref_kv_unpack(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Torch reference (and the CPU path) of kv_unpack."""
    kv_cache.index_copy_(2, block_ids.long(), buffer)


def _launch(
    kv_cache: torch.Tensor, buffer: torch.Tensor, ids: torch.Tensor, *, to_buffer: bool
) -> None:
    num_layers, _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    if ids.numel() == 0:
        return
    chunk_numel = num_kv_heads * block_size * head_dim
    block = min(triton.next_power_of_2(chunk_numel), _MAX_TILE)
    bits = _BITS_DTYPE[kv_cache.element_size()]
    cache_bits, buffer_bits = kv_cache.view(bits), buffer.view(bits)
    grid = (ids.numel(), num_layers * 2, triton.cdiv(chunk_numel, block))
    launch(
        _kv_pack_kernel,
        grid,
        cache_bits,
        buffer_bits,
        ids,
        chunk_numel,
        *cache_bits.stride()[:3],
        *buffer_bits.stride()[:3],
        TO_BUFFER=to_buffer,
        BLOCK=block,
        num_warps=4 if block >= 1024 else 1,
        enable_fp_fusion=False,  # a pure copy; saying so silences Triton 3.9's default warning
    )


def _buffer_shape(kv_cache: torch.Tensor, num_listed: int) -> tuple[int, ...]:
    num_layers, _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    return (num_layers, 2, num_listed, num_kv_heads, block_size, head_dim)


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]; "
            f"got {tuple(kv_cache.shape)}"
        )
    if kv_cache.element_size() not in _BITS_DTYPE:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} has an unsupported item size")
    _, _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    chunk_strides = (block_size * head_dim, head_dim, 1)
    # A size-1 dim's stride never moves the flat offset, so only the others must match.
    sizes = (num_kv_heads, block_size, head_dim)
    sizes_strides = zip(sizes, kv_cache.stride()[3:], chunk_strides, strict=True)
    if any(size > 1 and stride != want for size, stride, want in sizes_strides):
        raise ValueError(
            "each block of kv_cache must be one contiguous [num_kv_heads, block_size, head_dim] "
            f"chunk (strides {chunk_strides}); got strides {kv_cache.stride()[3:]}"
        )
    check_device(_kv_pack_kernel, "ref_kv_pack / ref_kv_unpack", kv_cache)


def _block_ids_on_device(
    block_ids: torch.Tensor, kv_cache: torch.Tensor, *, allow_repeats: bool
) -> torch.Tensor:
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_ids must be a 1-D int32 or int64 tensor; got {block_ids.dtype} "
            f"{tuple(block_ids.shape)}"
        )
    num_blocks = kv_cache.shape[2]
    if block_ids.numel() > 0:
        low, high = (int(x) for x in torch.aminmax(block_ids))
        if low < 0 or high >= num_blocks:
            raise ValueError(f"block ids must lie in [0, {num_blocks}); got {low}..{high}")
        if not allow_repeats and torch.unique(block_ids).numel() != block_ids.numel():
            raise ValueError("block_ids to unpack into must not repeat a block id")
    # Ids usually come from Python lists, so on CPU: checked there for free, then moved.
    return block_ids.to(kv_cache.device, non_blocking=True)


def _check_buffer(
    buffer: torch.Tensor, kv_cache: torch.Tensor, shape: tuple[int, ...], name: str
) -> None:
    if tuple(buffer.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} to match kv_cache; got {buffer.shape}")
    if buffer.dtype != kv_cache.dtype:
        raise ValueError(
            f"{name} dtype {buffer.dtype} differs from kv_cache dtype {kv_cache.dtype}"
        )
    if buffer.device != kv_cache.device:
        raise ValueError(f"{name} is on {buffer.device} but kv_cache on {kv_cache.device}")
    if not buffer.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is the wire format)")
