"""Shared setup of the kernel tests: Triton's interpreter on CPU, `device`, paged caches."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

# TRITON_INTERPRET is set in tests/conftest.py, before any kernel module is imported.


@pytest.fixture
def device() -> str:
    """Where kernel tests put their tensors: the GPU if there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# k_cache, v_cache, block_tables, and each sequence's dense K and V [n, KVH, D].
PagedKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]


@pytest.fixture
def make_paged_kv() -> Callable[..., PagedKV]:
    """Factory of paged caches; see `build_paged_kv`."""
    return build_paged_kv


def build_paged_kv(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> PagedKV:
    """Random K/V per sequence, scattered into shuffled blocks of a NaN-filled cache.

    Every slot no sequence owns is NaN, so a kernel that reads past a sequence's end or
    through a padding entry of a block table fails its comparison. Block 0 is never owned
    and pads every block table, which always has at least one spare column. The cache is
    `[num_blocks, KVH, block_size, D]` (engine/modeling/attention.py).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = 1 + sum(blocks_per_seq)
    shuffled = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    dense_k, dense_v = [], []
    for b, n in enumerate(context_lens):
        owned = [shuffled.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        pos = torch.arange(n)
        blocks = block_tables[b, pos // block_size].long()
        k_cache[blocks, :, pos % block_size] = k  # [n, KVH, D]
        v_cache[blocks, :, pos % block_size] = v
        dense_k.append(k.to(dtype))
        dense_v.append(v.to(dtype))
    return (
        k_cache.to(dtype=dtype, device=device),
        v_cache.to(dtype=dtype, device=device),
        block_tables.to(device),
        dense_k,
        dense_v,
    )


def quantize_paged_kv(paged: PagedKV, kv_cache_dtype: str) -> PagedKV:
    """`paged` with its caches as 8-bit rows (engine/modeling/kv_quant.py): uint8
    [num_blocks, KVH, block_size, D + 2]. An unowned (NaN) slot's row gets a NaN scale,
    so reading it still turns the output NaN."""
    from pdserve.engine.modeling import kv_quant

    k_cache, v_cache, *rest = paged
    k8, v8 = (kv_quant.quantize(c.float(), kv_cache_dtype) for c in (k_cache, v_cache))
    assert kv_quant.scales(k8).isnan().any()  # the poison survived
    return (k8, v8, *rest)  # type: ignore[return-value]


def dequantize_cache(cache: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """An 8-bit cache's values in float32 (exact: codes times bf16 scales)."""
    from pdserve.engine.modeling import kv_quant

    return kv_quant.dequantize(cache, kv_cache_dtype, torch.float32)


@pytest.fixture
def quantize_kv() -> Callable[[PagedKV, str], PagedKV]:
    """`quantize_paged_kv`: a paged cache of conftest's factory as 8-bit rows."""
    return quantize_paged_kv


@pytest.fixture
def dequantize_kv() -> Callable[[torch.Tensor, str], torch.Tensor]:
    """`dequantize_cache`: an 8-bit cache's values in float32."""
    return dequantize_cache
