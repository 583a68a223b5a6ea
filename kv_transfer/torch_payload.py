"""Where KV payloads meet torch: an engine cache's transfer layout, bytes <-> tensors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from pdserve.kv_transfer.base import QUANTIZED_ROW_EXTRA, HeadRange, KVLayout, ReceivedKV

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def layout_of(kv_cache: torch.Tensor, kv_cache_dtype: str = "auto") -> KVLayout:
    """Layout of an engine's cache [layers, 2, blocks, kv_heads, block_size, head_dim],
    or of an 8-bit one (`kv_cache_dtype` int8 or fp8: uint8 rows of head_dim + 2 bytes,
    engine/modeling/kv_quant.py)."""
    num_layers, _, _, num_kv_heads, block_size, row = kv_cache.shape
    if kv_cache_dtype in QUANTIZED_ROW_EXTRA:
        if kv_cache.dtype != torch.uint8:
            raise ValueError(f"a {kv_cache_dtype} KV cache is uint8 rows, not {kv_cache.dtype}")
        head_dim = row - QUANTIZED_ROW_EXTRA[kv_cache_dtype]
        return KVLayout(num_layers, num_kv_heads, head_dim, block_size, kv_cache_dtype)
    if kv_cache_dtype != "auto" or kv_cache.dtype not in DTYPE_NAMES:
        raise ValueError(f"no KV layout for a {kv_cache.dtype} cache of {kv_cache_dtype!r}")
    return KVLayout(num_layers, num_kv_heads, row, block_size, DTYPE_NAMES[kv_cache.dtype])


def payload_bytes(payload: torch.Tensor) -> np.ndarray:
    """A packed payload tensor (on CPU) as flat uint8 bytes, without a copy.

    Raises ValueError for a tensor on another device: an export reaches host memory
    through the engine's KVStaging (engine/worker/kv_staging.py), never through here.
    """
    if payload.device.type != "cpu":
        raise ValueError(
            f"a KV payload must be in host memory to be sent; got a tensor on {payload.device}"
            " (KVExport.wait() returns the host copy)"
        )
    return payload.contiguous().view(torch.uint8).reshape(-1).numpy()


def payload_tensor(data: np.ndarray, layout: KVLayout) -> torch.Tensor:
    """Received bytes as [layers, 2, n, kv_heads, block_size, head_dim] (an 8-bit layout:
    uint8 [..., block_size, head_dim + 2]), without a copy.

    The tensor is on CPU over `data` (pageable memory): the engine's import copies it into
    its cache synchronously, so `data` may be released once the import returns.
    """
    num_blocks = data.size // layout.block_bytes
    shape = (layout.num_layers, 2, num_blocks, layout.num_kv_heads, layout.block_size)
    flat = torch.from_numpy(data)
    if layout.dtype in QUANTIZED_ROW_EXTRA:  # uint8 rows, as the 8-bit cache holds them
        return flat.view(*shape, layout.row_bytes)
    return flat.view(DTYPES[layout.dtype]).view(*shape, layout.head_dim)


def part_layout(layout: KVLayout, kv_heads: HeadRange) -> KVLayout:
    """The layout of a part holding KV heads `kv_heads` [start, end) of `layout`'s blocks:
    the same but for `num_kv_heads`, the range's width (a part's header carries it)."""
    start, end = kv_heads
    if not 0 <= start < end:
        raise ValueError(f"KV heads [{start}, {end}) are no range of heads")
    return replace(layout, num_kv_heads=end - start)


def received_tensors(received: ReceivedKV) -> list[tuple[HeadRange, torch.Tensor]]:
    """Each part of `received`, by head start, as (its global KV heads, its payload as
    [layers, 2, n, its heads, block_size, head_dim]), without a copy: the pieces a
    decode rank copies into its cache, whether the KV came in one part or several."""
    return [(p.kv_heads, payload_tensor(p.payload, p.header.layout)) for p in received.parts]
