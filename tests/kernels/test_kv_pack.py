"""kv_pack / kv_unpack (Triton) against the wire layout, their references and each other.

On CPU the kernels run in Triton's interpreter (see conftest.py), which is slow: shapes stay
tiny. Packing is a byte copy, so every comparison is bitwise, on integer views of the data
(caches are random bit patterns, NaN payloads included). bf16 runs on CPU here too, unlike in
the other kernel tests: the kernel moves int16 bits and never does bf16 arithmetic, the one
thing the interpreter gets wrong.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.kernels.kv_pack import (
    kv_pack,
    kv_pack_num_bytes,
    kv_unpack,
    ref_kv_pack,
    ref_kv_unpack,
)

# Compiled Triton only: under TRITON_INTERPRET=1 even a GPU's tensors go through the interpreter.
NEEDS_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a GPU (compiled Triton)",
)
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32}

# Every size a non-power of two. Source and destination caches differ in block count and
# contents; the ids include each cache's first and last block, in no particular order.
LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 2, 3, 5, 6
SRC_BLOCKS, SRC_IDS = 7, [6, 0, 3]
DST_BLOCKS, DST_IDS = 9, [2, 8, 5]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of `dtype` holding uniformly random bit patterns (NaNs and infinities too)."""
    gen = torch.Generator().manual_seed(seed)
    bits = BITS[dtype.itemsize]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=bits).view(dtype)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.element_size()])


def cache(num_blocks: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    shape = (LAYERS, 2, num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    return random_bits(shape, dtype, seed).to(device)


def run_roundtrip(dtype: torch.dtype, id_dtype: torch.dtype, device: str) -> None:
    src = cache(SRC_BLOCKS, dtype, device, seed=0)
    dst0 = cache(DST_BLOCKS, dtype, device, seed=1)
    src_ids = torch.tensor(SRC_IDS, dtype=id_dtype, device=device)
    dst_ids = torch.tensor(DST_IDS, dtype=id_dtype, device=device)

    buffer = kv_pack(src, src_ids)
    n = len(SRC_IDS)
    assert buffer.shape == (LAYERS, 2, n, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    assert buffer.dtype == dtype and buffer.is_contiguous()
    num_bytes = kv_pack_num_bytes(
        num_layers=LAYERS,
        num_blocks=n,
        num_kv_heads=KV_HEADS,
        block_size=BLOCK_SIZE,
        head_dim=HEAD_DIM,
        dtype=dtype,
    )
    assert buffer.numel() * buffer.element_size() == num_bytes
    # The wire layout, pinned: buffer[l, kv, i] == kv_cache[l, kv, block_ids[i]].
    for i, block in enumerate(SRC_IDS):
        assert torch.equal(bits_of(buffer[:, :, i]), bits_of(src[:, :, block]))
    assert torch.equal(bits_of(buffer), bits_of(ref_kv_pack(src, src_ids)))

    dst = dst0.clone()
    kv_unpack(buffer, dst, dst_ids)
    for src_block, dst_block in zip(SRC_IDS, DST_IDS, strict=True):
        assert torch.equal(bits_of(dst[:, :, dst_block]), bits_of(src[:, :, src_block]))
    untouched = [b for b in range(DST_BLOCKS) if b not in DST_IDS]
    assert torch.equal(bits_of(dst[:, :, untouched]), bits_of(dst0[:, :, untouched]))
    expected = dst0.clone()
    ref_kv_unpack(buffer, expected, dst_ids)
    assert torch.equal(bits_of(dst), bits_of(expected))


@pytest.mark.parametrize(
    ("dtype", "id_dtype"),
    [
        (torch.float32, torch.int64),
        (torch.float16, torch.int32),
        (torch.bfloat16, torch.int64),
        # an 8-bit KV cache (engine/modeling/kv_quant.py): uint8 rows of codes and their scale bytes
        (torch.uint8, torch.int32),
    ],
)
def test_pack_then_unpack_elsewhere_is_byte_exact(
    dtype: torch.dtype, id_dtype: torch.dtype, device: str
) -> None:
    run_roundtrip(dtype, id_dtype, device)


@NEEDS_GPU
def test_pack_then_unpack_elsewhere_bf16_gpu() -> None:
    run_roundtrip(torch.bfloat16, torch.int32, "cuda")


def test_layer_group_into_given_buffer_spans_tiles(device: str) -> None:
    # A block chunk of 2 * 33 * 70 = 4620 elements is more than one tile (4096 elements).
    full = random_bits((3, 2, 4, 2, 33, 70), torch.float16, seed=2).to(device)
    ids = torch.tensor([3, 1], device=device)
    out = torch.empty((2, 2, 2, 2, 33, 70), dtype=torch.float16, device=device)
    group = kv_pack(full[1:], ids, out=out)  # layers 1 and 2: a layer group
    assert group is out
    assert torch.equal(bits_of(group), bits_of(ref_kv_pack(full, ids)[1:]))


def test_no_blocks(device: str) -> None:
    src = cache(SRC_BLOCKS, torch.float32, device, seed=0)
    before = src.clone()
    ids = torch.empty(0, dtype=torch.int64, device=device)
    buffer = kv_pack(src, ids)
    assert buffer.shape == (LAYERS, 2, 0, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    kv_unpack(buffer, src, ids)
    assert torch.equal(bits_of(src), bits_of(before))


def test_rejects_bad_block_ids(device: str) -> None:
    src = cache(SRC_BLOCKS, torch.float32, device, seed=0)
    buffer = kv_pack(src, torch.tensor([0, 1], device=device))
    for bad in ([0, SRC_BLOCKS], [-1, 2]):
        with pytest.raises(ValueError, match="must lie in"):
            kv_pack(src, torch.tensor(bad, device=device))
        with pytest.raises(ValueError, match="must lie in"):
            kv_unpack(buffer, src, torch.tensor(bad, device=device))
    with pytest.raises(ValueError, match="int32 or int64"):
        kv_pack(src, torch.tensor([0.0, 1.0], device=device))
    with pytest.raises(ValueError, match="int32 or int64"):
        kv_pack(src, torch.tensor([[0, 1]], device=device))
    with pytest.raises(ValueError, match="must not repeat"):
        kv_unpack(buffer, src, torch.tensor([1, 1], device=device))


def test_rejects_mismatched_buffers_and_caches(device: str) -> None:
    src = cache(SRC_BLOCKS, torch.float32, device, seed=0)
    ids = torch.tensor([0, 1], device=device)
    buffer = kv_pack(src, ids)
    with pytest.raises(ValueError, match="must have shape"):
        kv_unpack(buffer, src, ids[:1])
    other_layout = random_bits((LAYERS, 2, SRC_BLOCKS, KV_HEADS, BLOCK_SIZE, 4), torch.float32, 3)
    with pytest.raises(ValueError, match="must have shape"):
        kv_unpack(buffer, other_layout.to(device), ids)  # a cache of another head_dim
    with pytest.raises(ValueError, match="dtype"):
        kv_unpack(buffer.half(), src, ids)
    with pytest.raises(ValueError, match="contiguous"):
        kv_unpack(buffer.transpose(4, 5).contiguous().transpose(4, 5), src, ids)
    with pytest.raises(ValueError, match="must have shape"):
        kv_pack(src, ids, out=torch.empty_like(buffer)[:, :, :1])
    with pytest.raises(ValueError, match="contiguous"):
        kv_pack(src.transpose(4, 5), ids)  # blocks no longer contiguous chunks
    with pytest.raises(ValueError, match="num_layers, 2"):
        kv_pack(src[0], ids)
