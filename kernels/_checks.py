"""Input checks the kernel launchers share (clear ValueErrors before any launch)."""

from __future__ import annotations

import torch
from triton.runtime import JITFunction

from pdserve.kernels._kv8 import check_cache_rows, kv_quant_of


def check_device(kernel: object, reference: str, *tensors: torch.Tensor) -> None:
    """All tensors on one device, and that device CUDA unless `kernel` is interpreted.

    NOTE: under TRITON_INTERPRET=1, `triton.jit` returns an interpreted function (not a
    JITFunction) that runs on CPU tensors; tests rely on that.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
    device = devices.pop()
    if isinstance(kernel, JITFunction) and device.type != "cuda":
        raise ValueError(
            f"the Triton kernel needs CUDA tensors, got {device}; use {reference} on CPU"
        )


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    supported_dtypes: tuple[torch.dtype, ...],
    max_head_dim: int,
    kv_cache_dtype: str = "auto",
) -> None:
    """q [rows, H, D] against one layer's paged cache [num_blocks, KVH, block_size, D]
    (for an 8-bit `kv_cache_dtype`, uint8 rows of D + 2 bytes: kernels/_kv8.py)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [rows, heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, kv_heads, block_size, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    quantized = kv_quant_of(kv_cache_dtype) != 0
    if quantized:
        if q.dtype not in supported_dtypes:
            raise ValueError(f"q must be one of {supported_dtypes}, got {q.dtype}")
        check_cache_rows(k_cache, head_dim, kv_cache_dtype, q.dtype, "k_cache")
        check_cache_rows(v_cache, head_dim, kv_cache_dtype, q.dtype, "v_cache")
    elif q.dtype not in supported_dtypes or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache, v_cache must share one of {supported_dtypes}, got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if (not quantized and k_cache.shape[3] != head_dim) or head_dim > max_head_dim:
        raise ValueError(
            f"head_dim of q ({head_dim}) and cache ({k_cache.shape[3]}) must match "
            f"and be <= {max_head_dim}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
