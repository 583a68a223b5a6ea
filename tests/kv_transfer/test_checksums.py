"""Block checksums computed row by row as a payload arrives equal the whole-payload ones."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import xxhash

from pdserve.kv_transfer.base import (
    BlockHasher,
    KVLayout,
    block_checksums,
    row_chunks,
    tune_malloc,
)
from pdserve.kv_transfer.errors import TruncatedError

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def payload(num_blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, num_blocks * LAYOUT.block_bytes, dtype=np.uint8)


def reference(data: np.ndarray, num_blocks: int) -> list[int]:
    """Block i's checksum from its definition: xxh3 of its slabs, (layer, kv) order."""
    # layer-major payload [num_layers, 2, num_blocks, slab]
    rows = data.reshape(2 * LAYOUT.num_layers, num_blocks, LAYOUT.slab_bytes)
    return [xxhash.xxh3_64(rows[:, i].tobytes()).intdigest() for i in range(num_blocks)]


@pytest.mark.parametrize("splits", [[6], [1, 6], [2, 3, 6], [1, 2, 3, 4, 5, 6]])
def test_rows_hashed_in_any_split_give_the_defined_checksums(splits: list[int]) -> None:
    data = payload(5)
    hasher = BlockHasher(LAYOUT, 5)
    for end in splits:
        hasher.update(data, end)
    assert list(hasher.checksums()) == reference(data, 5)
    assert list(block_checksums(data, LAYOUT, 5)) == reference(data, 5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bytes_hashed_in_any_split_give_the_defined_checksums(seed: int) -> None:
    """Chunk boundaries anywhere (mid-slab too, as gRPC messages fall): every slab is
    hashed once, when its last byte is in, and the result is the defined checksum."""
    data = payload(5, seed)
    rng = np.random.default_rng(seed)
    ends = [*sorted(rng.integers(0, data.size, 7).tolist()), data.size]
    hasher = BlockHasher(LAYOUT, 5)
    for end in ends:
        hasher.update_bytes(data, end)
        assert hasher.slabs_done == end // LAYOUT.slab_bytes
    assert list(hasher.checksums()) == reference(data, 5)


def test_checksums_of_an_incompletely_hashed_payload_are_refused() -> None:
    hasher = BlockHasher(LAYOUT, 2)
    hasher.update(payload(2), 5)
    with pytest.raises(TruncatedError, match="5 of 6 rows"):
        hasher.checksums()
    with pytest.raises(TruncatedError):
        hasher.update(payload(3), 6)  # not this payload's size


@pytest.mark.parametrize("num_blocks", [1, 7, 4096, 70_000])
@pytest.mark.parametrize("max_chunks", [1, 4, 16])
def test_row_chunks_cover_every_row_once_in_order(num_blocks: int, max_chunks: int) -> None:
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    chunks = row_chunks(layout, num_blocks, max_chunks=max_chunks)
    assert chunks[0][0] == 0 and chunks[-1][1] == 64
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    assert len(chunks) <= max_chunks
    row_bytes = num_blocks * layout.slab_bytes
    # chunks are at least 2 MiB where the payload allows it (fewer, larger messages)
    assert all((end - start) * row_bytes >= 2 << 20 for start, end in chunks[:-1])


def test_tune_malloc_applies_on_glibc() -> None:
    assert tune_malloc() is True  # this machine runs glibc; elsewhere it returns False
