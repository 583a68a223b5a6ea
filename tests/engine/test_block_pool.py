"""Tests for BlockPool on tiny pools: exact block ids, eviction order, ref counts, events."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pdserve.common.hashing import BlockHash, hash_block_chain, hash_namespace
from pdserve.engine.sched.block_pool import (
    BlockPool,
    KVBlock,
    KVEvent,
    KVEventKind,
    NoFreeBlocksError,
)

BLOCK_SIZE = 4
NAMESPACE = hash_namespace("demo")
STORED = KVEventKind.STORED
REMOVED = KVEventKind.REMOVED


def chain(token_ids: Sequence[int]) -> list[BlockHash]:
    return hash_block_chain(token_ids, BLOCK_SIZE, NAMESPACE)


def ids(blocks: Sequence[KVBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def cache_all(pool: BlockPool, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash]) -> None:
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.cache_full_block(block, block_hash)


def test_initial_state_and_allocation_in_id_order() -> None:
    pool = BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.num_free_blocks == 5
    assert pool.usage == 0.0
    first = pool.allocate(2)
    second = pool.allocate(3)
    assert ids(first) == [0, 1]
    assert ids(second) == [2, 3, 4]
    assert all(block.ref_count == 1 and block.block_hash is None for block in first + second)
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    assert pool.allocate(0) == []
    pool.free(reversed(second))
    pool.free(reversed(first))
    pool.check_no_leaks()


def test_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free(reversed(blocks[:2]))
    pool.free([blocks[3]])
    assert pool.num_free_blocks == 3
    assert pool.usage == 0.25
    again = pool.allocate(3)
    assert ids(again) == [1, 0, 3]
    pool.free([*again, blocks[2]])
    pool.check_no_leaks()


def test_reverse_free_evicts_tail_blocks_first() -> None:
    pool = BlockPool(6, enable_events=True)
    hashes = chain(range(12))
    blocks = pool.allocate(3)
    cache_all(pool, blocks, hashes)
    pool.free(reversed(blocks))
    # Free queue: 3, 4, 5 (never used), then 2, 1, 0 (freed tail first).
    assert pool.num_free_blocks == 6
    taken = pool.allocate(4)
    assert ids(taken) == [3, 4, 5, 2]
    assert pool.get_cached_block(hashes[2]) is None
    assert ids(pool.get_computed_blocks(hashes)) == [0, 1]
    assert pool.drain_events() == [
        KVEvent(STORED, tuple(hashes)),
        KVEvent(REMOVED, (hashes[2],)),
    ]
    pool.free(taken)
    pool.check_no_leaks()


def test_least_recently_freed_cached_block_is_evicted_first() -> None:
    pool = BlockPool(2, enable_events=True)
    hash_a, hash_b = chain([1, 1, 1, 1])[0], chain([2, 2, 2, 2])[0]
    block_a, block_b = pool.allocate(2)
    pool.cache_full_block(block_a, hash_a)
    pool.cache_full_block(block_b, hash_b)
    pool.free([block_a])
    pool.free([block_b])
    pool.drain_events()
    (taken,) = pool.allocate(1)
    assert taken is block_a
    assert pool.get_cached_block(hash_a) is None
    assert pool.get_cached_block(hash_b) is block_b
    assert pool.drain_events() == [KVEvent(REMOVED, (hash_a,))]
    pool.free([taken])
    pool.check_no_leaks()


def test_touch_takes_cached_free_block_out_of_queue() -> None:
    pool = BlockPool(4)
    hashes = chain(range(8))
    blocks = pool.allocate(2)
    cache_all(pool, blocks, hashes)
    pool.free(reversed(blocks))
    hit = pool.get_computed_blocks(hashes)
    assert ids(hit) == [0, 1]
    assert [block.ref_count for block in hit] == [0, 0]  # lookup does not touch
    pool.touch(hit)
    assert [block.ref_count for block in hit] == [1, 1]
    assert pool.num_free_blocks == 2
    others = pool.allocate(2)
    assert ids(others) == [2, 3]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert pool.get_computed_blocks(hashes) == hit  # touched blocks stay cached
    pool.free(reversed(hit))
    pool.free(others)
    pool.check_no_leaks()


def test_get_computed_blocks_stops_at_first_miss() -> None:
    pool = BlockPool(4)
    hashes = chain(range(12))
    blocks = pool.allocate(3)
    pool.cache_full_block(blocks[0], hashes[0])
    pool.cache_full_block(blocks[2], hashes[2])
    assert ids(pool.get_computed_blocks(hashes)) == [0]
    assert pool.get_computed_blocks(hashes[1:]) == []
    assert pool.get_computed_blocks([]) == []
    pool.free(reversed(blocks))
    pool.check_no_leaks()


def test_shared_prefix_has_ref_count_two() -> None:
    pool = BlockPool(6, enable_events=True)
    hashes_a = chain([0, 1, 2, 3, 4, 5, 6, 7])
    hashes_b = chain([0, 1, 2, 3, 9, 9, 9, 9])
    assert hashes_a[0] == hashes_b[0] and hashes_a[1] != hashes_b[1]
    blocks_a = pool.allocate(2)
    cache_all(pool, blocks_a, hashes_a)

    hit = pool.get_computed_blocks(hashes_b)
    assert ids(hit) == [0]
    pool.touch(hit)
    blocks_b = hit + pool.allocate(1)
    assert ids(blocks_b) == [0, 2]
    assert blocks_a[0].ref_count == 2
    pool.cache_full_block(blocks_b[1], hashes_b[1])

    pool.free(reversed(blocks_a))
    assert [block.ref_count for block in blocks_a] == [1, 0]
    pool.free(reversed(blocks_b))
    pool.check_no_leaks()
    # Queue: 3, 4, 5, then A's tail (1), B's tail (2), the shared head (0).
    pool.drain_events()
    everything = pool.allocate(6)
    assert ids(everything) == [3, 4, 5, 1, 2, 0]
    assert pool.drain_events() == [KVEvent(REMOVED, (hashes_a[1], hashes_b[1], hashes_a[0]))]
    pool.free(everything)
    pool.check_no_leaks()


def test_duplicate_block_stays_uncached() -> None:
    pool = BlockPool(3, enable_events=True)
    (block_hash,) = chain(range(4))
    first, duplicate = pool.allocate(2)
    pool.cache_full_block(first, block_hash)
    pool.cache_full_block(duplicate, block_hash)
    assert pool.get_cached_block(block_hash) is first
    assert duplicate.block_hash is None
    assert pool.drain_events() == [KVEvent(STORED, (block_hash,))]
    pool.free([duplicate, first])
    # Reusing the duplicate evicts nothing; the original keeps its hash until taken.
    reused = pool.allocate(2)
    assert ids(reused) == [2, 1]
    assert pool.drain_events() == []
    assert pool.get_cached_block(block_hash) is first
    pool.free(reused)
    pool.check_no_leaks()


def test_cache_full_block_is_idempotent_and_rejects_a_second_hash() -> None:
    pool = BlockPool(2, enable_events=True)
    hash_0, hash_1 = chain(range(8))
    (block,) = pool.allocate(1)
    pool.cache_full_block(block, hash_0)
    pool.cache_full_block(block, hash_0)
    assert pool.drain_events() == [KVEvent(STORED, (hash_0,))]
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_full_block(block, hash_1)
    assert pool.get_cached_block(hash_1) is None
    pool.free([block])
    pool.check_no_leaks()


def test_no_free_blocks_allocates_nothing() -> None:
    pool = BlockPool(3, enable_events=True)
    (block_hash,) = chain(range(4))
    held = pool.allocate(2)
    pool.cache_full_block(held[1], block_hash)
    pool.free([held[1]])
    pool.drain_events()
    with pytest.raises(NoFreeBlocksError, match="requested 3 blocks but only 2 are free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2
    assert pool.get_cached_block(block_hash) is held[1]  # nothing evicted
    assert pool.drain_events() == []
    rest = pool.allocate(2)
    assert ids(rest) == [2, 1]
    pool.free(rest + held[:1])
    pool.check_no_leaks()


def test_double_free_raises_and_frees_nothing() -> None:
    pool = BlockPool(2)
    block, other = pool.allocate(2)
    with pytest.raises(ValueError, match="block 0 freed 2 time"):
        pool.free([other, block, block])
    assert (block.ref_count, other.ref_count) == (1, 1)
    assert pool.num_free_blocks == 0
    pool.free([block, other])
    with pytest.raises(ValueError, match="ref_count 0"):
        pool.free([block])
    pool.check_no_leaks()


def test_touch_of_referenced_block_keeps_queue() -> None:
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2
    assert pool.num_free_blocks == 2
    pool.free([block])
    pool.free([block])
    everything = pool.allocate(3)
    assert ids(everything) == [1, 2, 0]
    pool.free(everything)
    pool.check_no_leaks()


def test_caching_disabled() -> None:
    pool = BlockPool(3, enable_caching=False, enable_events=True)
    hashes = chain(range(8))
    blocks = pool.allocate(2)
    cache_all(pool, blocks, hashes)
    assert all(block.block_hash is None for block in blocks)
    assert pool.get_cached_block(hashes[0]) is None
    assert pool.get_computed_blocks(hashes) == []
    pool.free(reversed(blocks))
    everything = pool.allocate(3)
    assert ids(everything) == [2, 1, 0]
    assert pool.drain_events() == []
    assert pool.reset_prefix_cache()
    pool.free(everything)
    pool.check_no_leaks()


def test_events_merge_consecutive_kinds_and_drain_clears() -> None:
    pool = BlockPool(2, enable_events=True)
    hashes = chain(range(12))
    blocks = pool.allocate(2)
    pool.cache_full_block(blocks[0], hashes[0])
    pool.cache_full_block(blocks[1], hashes[1])
    pool.free([blocks[0]])
    (reused,) = pool.allocate(1)
    pool.cache_full_block(reused, hashes[2])
    assert pool.drain_events() == [
        KVEvent(STORED, (hashes[0], hashes[1])),
        KVEvent(REMOVED, (hashes[0],)),
        KVEvent(STORED, (hashes[2],)),
    ]
    assert pool.drain_events() == []
    pool.free([reused, blocks[1]])
    pool.check_no_leaks()


def test_events_disabled_records_nothing() -> None:
    pool = BlockPool(1)
    (block,) = pool.allocate(1)
    pool.cache_full_block(block, chain(range(4))[0])
    pool.free([block])
    pool.free(pool.allocate(1))
    assert pool.drain_events() == []
    pool.check_no_leaks()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(4, enable_events=True)
    hashes = chain(range(8))
    blocks = pool.allocate(2)
    cache_all(pool, blocks, hashes)
    pool.drain_events()
    pool.free([blocks[1]])
    assert not pool.reset_prefix_cache()  # block 0 is still referenced
    assert pool.get_computed_blocks(hashes) == blocks
    assert pool.drain_events() == []

    pool.free([blocks[0]])
    assert pool.reset_prefix_cache()
    assert pool.get_computed_blocks(hashes) == []
    assert all(block.block_hash is None for block in blocks)
    assert pool.drain_events() == [KVEvent(REMOVED, tuple(hashes))]
    # The free queue's order is unchanged: 2, 3, then the freed 1, 0.
    everything = pool.allocate(4)
    assert ids(everything) == [2, 3, 1, 0]
    assert pool.drain_events() == []
    pool.free(everything)
    pool.check_no_leaks()


def test_check_no_leaks_names_held_blocks() -> None:
    pool = BlockPool(4)
    held = pool.allocate(3)
    pool.free([held[1]])
    with pytest.raises(AssertionError, match=r"blocks still referenced: \[0, 2\]"):
        pool.check_no_leaks()
    pool.free([held[0], held[2]])
    pool.check_no_leaks()


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    pool = BlockPool(1)
    with pytest.raises(ValueError, match="num_blocks"):
        pool.allocate(-1)
    pool.check_no_leaks()
