"""Maps sequences to KV blocks: prefix-cache lookup, slot allocation, freeing.

Plain Python over `BlockPool`. A sequence owns `seq.blocks` (one reference each); full
blocks are registered under their chained hash as soon as their tokens are scheduled,
so a later request can share them.
"""

from __future__ import annotations

from pdserve.engine.sched.block_pool import BlockPool, KVBlock
from pdserve.engine.sched.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def get_computed_blocks(self, seq: Sequence) -> list[KVBlock]:
        """Cached blocks holding the longest prefix of `seq`'s tokens (not yet referenced).

        At least one token is always left to compute, because the step that computes the
        last token is the one that samples the next.
        """
        if not self.pool.enable_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = seq.full_block_hashes(self.block_size)[:max_blocks]
        return self.pool.get_computed_blocks(hashes)

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens of `seq`.

        `computed_blocks` (on admission only) are cached blocks the sequence reuses; they
        are referenced and appended first. Returns False, changing nothing, when the pool
        lacks free blocks.
        """
        computed_blocks = computed_blocks or []
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = cdiv(num_tokens + num_new_tokens, self.block_size)
        num_to_allocate = num_needed - len(seq.blocks) - len(computed_blocks)
        # Touching a free cached block takes it out of the free queue, too.
        num_evictable = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_to_allocate + num_evictable > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed_blocks)
        seq.blocks.extend(computed_blocks)
        if num_to_allocate > 0:
            seq.blocks.extend(self.pool.allocate(num_to_allocate))
        self._cache_full_blocks(seq, num_tokens + num_new_tokens)
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past `seq`'s tokens: after a verify row (speculative
        decoding) they held only rejected proposals' slots. They are never registered
        (only blocks full of the sequence's tokens are) and go to the head of the free
        queue, the next to be allocated, ahead of blocks still cached."""
        keep = cdiv(seq.num_tokens, self.block_size)
        extra = seq.blocks[keep:]
        if extra:
            assert all(b.block_hash is None for b in extra)
            del seq.blocks[keep:]
            self.pool.free(reversed(extra), front=True)

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        # Only blocks full of the sequence's own tokens: a verify row's slots past them
        # (proposals, maybe rejected) never make a block count as full here.
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = seq.full_block_hashes(self.block_size)
        for i in range(seq.num_registered_blocks, num_full):
            if seq.blocks[i].block_hash is None:
                self.pool.cache_full_block(seq.blocks[i], hashes[i])
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its tail blocks become the first to be evicted."""
        self.pool.free(reversed(seq.blocks))
        seq.blocks = []
        seq.num_registered_blocks = 0
