"""Where KV payloads meet torch: an engine cache's transfer layout, bytes <-> tensors."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kv_transfer.base import KVLayout

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def layout_of(kv_cache: torch.Tensor) -> KVLayout:
    """Layout of an engine's cache [layers, 2, blocks, kv_heads, block_size, head_dim]."""
    num_layers, _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    return KVLayout(num_layers, num_kv_heads, head_dim, block_size, DTYPE_NAMES[kv_cache.dtype])


def payload_bytes(payload: torch.Tensor) -> np.ndarray:
    """A packed payload tensor (on CPU) as flat uint8 bytes, without a copy.

    Raises ValueError for a tensor on another device: an export reaches host memory
    through the engine's KVStaging (engine/kv_staging.py), never through here.
    """
    if payload.device.type != "cpu":
        raise ValueError(
            f"a KV payload must be in host memory to be sent; got a tensor on {payload.device}"
            " (KVExport.wait() returns the host copy)"
        )
    return payload.contiguous().view(torch.uint8).reshape(-1).numpy()


def payload_tensor(data: np.ndarray, layout: KVLayout) -> torch.Tensor:
    """Received bytes as [layers, 2, n, kv_heads, block_size, head_dim], without a copy.

    The tensor is on CPU over `data` (pageable memory): the engine's import copies it into
    its cache synchronously, so `data` may be released once the import returns.
    """
    num_blocks = data.size // layout.block_bytes
    shape = (layout.num_layers, 2, num_blocks, layout.num_kv_heads, layout.block_size)
    flat = torch.from_numpy(data).view(DTYPES[layout.dtype])
    return flat.view(*shape, layout.head_dim)
