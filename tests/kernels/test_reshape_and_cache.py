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

from pdserve.engine.modeling import kv_quant
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


# -- 8-bit caches (engine/modeling/kv_quant.py) -------------------------------------------


def special_rows(
    head_dim: int, kv_dtype: str, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """Rows [n, head_dim] where the rounding is easy to get wrong: magnitudes across the
    dtype's range (1e-30..1e30 in float32: scales far from 1, bf16-rounded), all zeros,
    e4m3 subnormal codes, exact ties between two codes (int8 rounds them to even), the
    max itself, a lone value, -0.0."""
    qmax = kv_quant.qmax(kv_dtype)
    exponents = range(-30, 31, 6) if dtype == torch.float32 else range(-4, 5, 2)
    rows = [torch.randn(head_dim, generator=gen) * 10.0**e for e in exponents]
    rows.append(torch.zeros(head_dim))
    ties = torch.arange(head_dim, dtype=torch.float32) - head_dim / 2 + 0.5  # k + 0.5
    ties[0] = qmax  # the max: the scale is exactly 1
    rows.append(ties)
    sub = torch.randn(head_dim, generator=gen) * 2.0**-8  # e4m3 subnormals after scaling
    sub[0] = qmax
    rows.append(sub)
    lone = torch.zeros(head_dim)
    lone[3] = -7.25
    lone[4] = -0.0
    rows.append(lone)
    return torch.stack(rows)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_quantized_rows_are_kv_quants_bytes(kv_dtype: str, dtype: torch.dtype, device: str) -> None:
    """The kernel's 8-bit rows equal engine/modeling/kv_quant.py's `quantize`, byte for
    byte (an int8 tie, an e4m3 subnormal, a scale's bf16 rounding are all exact); padding and other
    slots keep their bytes."""
    run_quantized_case(kv_dtype, dtype, device)


@NEEDS_GPU
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_rows_are_kv_quants_bytes_bf16_gpu(kv_dtype: str) -> None:
    """The GPU twin of test_quantized_rows_are_kv_quants_bytes, from bf16 K/V."""
    run_quantized_case(kv_dtype, torch.bfloat16, "cuda")


def run_quantized_case(kv_dtype: str, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, head_dim, block_size, num_blocks = 3, 20, 4, 6
    special = special_rows(head_dim, kv_dtype, dtype, gen)  # one row per (token, head) below
    num_tokens = -(-special.shape[0] // num_kv_heads) + 4
    x = torch.randn(num_tokens * num_kv_heads, head_dim, generator=gen)
    x[: special.shape[0]] = special
    fused = torch.stack([x, torch.randn(x.shape, generator=gen)], dim=1)  # k, v interleaved
    fused = fused.view(num_tokens, num_kv_heads, 2, head_dim).to(device, dtype)
    k, v = fused[:, :, 0], fused[:, :, 1]  # strided views, as a fused qkv hands them over
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[2] = -1  # padding
    slot_mapping = slots.to(device)
    shape = (num_blocks, num_kv_heads, block_size, head_dim + 2)
    k_cache0 = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(device)
    v_cache0 = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(device)

    k_cache, v_cache = k_cache0.clone(), v_cache0.clone()
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype=kv_dtype)
    k_ref, v_ref = k_cache0.clone(), v_cache0.clone()

    def quantize(t: torch.Tensor) -> torch.Tensor:
        # NOTE: on the CPU, the format's definition: torch on CUDA divides by QMAX as a
        # multiplication by its reciprocal, which can round a scale differently
        return kv_quant.quantize(t.cpu(), kv_dtype).to(t.device)

    ref_reshape_and_cache(k, v, k_ref, v_ref, slot_mapping, quantize)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert not torch.equal(k_cache, k_cache0)
    # the special rows were written, and read back within their format's rounding
    block, offset = slots[1] // block_size, slots[1] % block_size
    row = kv_quant.quantize(k[1].float().cpu(), kv_dtype)
    assert torch.equal(k_cache[block, :, offset].cpu(), row)


def test_rejects_bad_8bit_caches(device: str) -> None:
    k = torch.randn(3, 2, 8, device=device)
    cache = torch.zeros(2, 2, 4, 10, dtype=torch.uint8, device=device)
    slots = torch.tensor([0, 1, 2], device=device)
    reshape_and_cache(k, k, cache, cache, slots, kv_cache_dtype="int8")  # D + 2 bytes: fine
    with pytest.raises(ValueError, match="share one dtype"):
        reshape_and_cache(k, k, cache.float(), cache.float(), slots, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="does not hold rows"):
        reshape_and_cache(k, k, cache[..., :8], cache[..., :8], slots, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        reshape_and_cache(k, k, cache, cache, slots, kv_cache_dtype="int4")
