"""reshape_and_cache (Triton) against its torch reference and against the slot arithmetic.

On CPU the kernel runs in Triton's interpreter (see conftest.py), which is slow: shapes stay
tiny. The kernel only copies, so every comparison is bitwise (atol=0, rtol=0). bf16 runs only
on a GPU: the interpreter computes bf16 arithmetic wrongly, and the fp32/fp16 cases are its
CPU twins.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.kernels.reshape_and_cache import ref_reshape_and_cache, reshape_and_cache

EXACT = {"atol": 0.0, "rtol": 0.0}
# Compiled Triton only: under TRITON_INTERPRET=1 even a GPU's tensors go through the interpreter.
NEEDS_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a GPU (compiled Triton)",
)

# (num_kv_heads, head_dim, block_size, num_blocks, slots). Each case writes the last slot of a
# block and the first of the next (ending exactly on, and one past, a block boundary), the
# cache's very last slot, and skips padding (-1).
CASES = [
    (1, 12, 4, 3, [3, 4, -1, 11, 0]),
    (2, 20, 8, 2, [7, 8, -1, -1, 15]),
    (3, 64, 16, 2, [16, 15, 31]),
]


def run_case(
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    slots: list[int],
    dtype: torch.dtype,
    device: str,
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens = len(slots)
    # k and v are strided views of one fused tensor, as the model's qkv split hands them over.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(device, dtype)
    k, v = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    cache_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache0 = torch.randn(cache_shape, generator=gen).to(device, dtype)
    v_cache0 = torch.randn(cache_shape, generator=gen).to(device, dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)

    k_cache, v_cache = k_cache0.clone(), v_cache0.clone()
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    k_ref, v_ref = k_cache0.clone(), v_cache0.clone()
    ref_reshape_and_cache(k, v, k_ref, v_ref, slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, **EXACT)
    torch.testing.assert_close(v_cache, v_ref, **EXACT)

    written = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=device)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        written[block, offset] = True
        torch.testing.assert_close(k_cache[block, :, offset], k[t], **EXACT)
        torch.testing.assert_close(v_cache[block, :, offset], v[t], **EXACT)
    # Padding tokens and unlisted slots leave the cache as it was.
    untouched = ~written  # [num_blocks, block_size]
    torch.testing.assert_close(
        k_cache.transpose(1, 2)[untouched], k_cache0.transpose(1, 2)[untouched], **EXACT
    )
    torch.testing.assert_close(
        v_cache.transpose(1, 2)[untouched], v_cache0.transpose(1, 2)[untouched], **EXACT
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size", "num_blocks", "slots"), CASES)
def test_matches_reference(
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    slots: list[int],
    dtype: torch.dtype,
    device: str,
) -> None:
    run_case(num_kv_heads, head_dim, block_size, num_blocks, slots, dtype, device)


@NEEDS_GPU
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size", "num_blocks", "slots"), CASES)
def test_matches_reference_bf16_gpu(
    num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int, slots: list[int]
) -> None:
    run_case(num_kv_heads, head_dim, block_size, num_blocks, slots, torch.bfloat16, "cuda")


def test_no_tokens_is_a_no_op(device: str) -> None:
    k = torch.empty(0, 2, 8, device=device)
    k_cache = torch.randn(2, 2, 4, 8, device=device)
    before = k_cache.clone()
    empty_slots = torch.empty(0, dtype=torch.int64, device=device)
    reshape_and_cache(k, k, k_cache, k_cache, empty_slots)
    torch.testing.assert_close(k_cache, before, **EXACT)


def test_rejects_bad_arguments(device: str) -> None:
    k = torch.randn(3, 2, 8, device=device)
    cache = torch.randn(2, 2, 4, 8, device=device)
    slots = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match="share one dtype"):
        reshape_and_cache(k, k, cache.half(), cache.half(), slots)
    with pytest.raises(ValueError, match="int64"):
        reshape_and_cache(k, k, cache, cache, slots.int())
    with pytest.raises(ValueError, match="int64"):
        reshape_and_cache(k, k, cache, cache, slots[:2])
    with pytest.raises(ValueError, match="does not hold rows"):
        reshape_and_cache(k, k, cache[..., :6], cache[..., :6], slots)
    with pytest.raises(ValueError, match="k and v"):
        reshape_and_cache(k, k[:, :1], cache, cache, slots)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        reshape_and_cache(k, k, cache, cache[0], slots)
